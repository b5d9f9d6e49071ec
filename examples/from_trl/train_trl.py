"""The TRL script: GRPOTrainer on a conversational dataset with two TRL rewards.

    python examples/from_trl/train_trl.py [MODEL_DIR] [OUTPUT_DIR]

MODEL_DIR defaults to SmolLM2-135M-Instruct as `nonstop model fetch smollm2` caches it. Its nonstop
version is train_nonstop.py, on the same data, rewards and GRPOConfig (common.py).
"""

from __future__ import annotations

import sys

from common import brief, correct, grpo_config, make_dataset
from trl import GRPOTrainer

MODEL = ".nonstop_cache/models/smollm2"


def main(model: str, output_dir: str) -> None:
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct, brief],
        args=grpo_config(output_dir),
        train_dataset=make_dataset(8),
    )
    trainer.train()


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else MODEL
    main(model, sys.argv[2] if len(sys.argv) > 2 else "runs/from_trl/trl")
