"""train_trl.py in nonstop: the same data, rewards and GRPOConfig, trained asynchronously.

    python examples/from_trl/train_nonstop.py [MODEL_DIR] [OUTPUT_DIR]

What changes from the TRL script: `nonstop.from_trl` turns the GRPOConfig into a nonstop Config
(and warns about any field it cannot carry over), and `nonstop.train` takes the dataset and the
reward functions as they are. nonstop also measures held-out prompts (here 4 rows of their own),
by the same rewards, before and after training. The call sits under `if __name__ == "__main__":`:
the engine and trainer processes start with 'spawn', which imports this script again.
"""

from __future__ import annotations

import sys

from common import brief, correct, grpo_config, make_dataset

import nonstop

MODEL = ".nonstop_cache/models/smollm2"


def main(model: str, output_dir: str) -> nonstop.RunSummary:
    args = grpo_config(output_dir)
    return nonstop.train(
        nonstop.from_trl(args, model=model),
        dataset=make_dataset(8),
        eval_dataset=make_dataset(4, start=100),
        reward=[correct, brief],
        reward_weights=args.reward_weights,
        progress="plain",
    )


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else MODEL
    main(model, sys.argv[2] if len(sys.argv) > 2 else "runs/from_trl/nonstop")
