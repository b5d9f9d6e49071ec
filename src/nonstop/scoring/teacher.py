"""The on-policy distillation teacher: logprobs of the student's own tokens, from its own actor.

`check_tokenizers(student_dir, teacher_dir)` runs at start-up: the teacher scores the student's
token ids as they are, so both must map the same strings to the same ids (same vocabulary, same
special tokens) and the teacher's embedding must cover every id; otherwise a `RewardError`
names what differs and the fix. `TeacherWorker` (an actor process) holds the teacher model and
answers `logprobs([(prompt_ids, completion_ids), ...])` with log pi_teacher(a_t) of every
completion token under the rollout temperature (no top-k/top-p: the KL is to the teacher's full
distribution). `TeacherComponent` batches the groups being scored into teacher calls
(pool.Batcher), restarts a dead teacher (`distill.max_restarts`), and records on every sample
the teacher's identity and version ('path@version'). The trainer turns the logprobs into the
per-token reverse-KL term (trainer/token_advantages.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig

from nonstop.config.scoring import DistillConfig
from nonstop.hf import load_model, load_tokenizer
from nonstop.runtime.base import ActorBackend
from nonstop.scoring.base import Contribution
from nonstop.scoring.pool import Batcher, TeacherPool
from nonstop.scoring.rewards import RewardError
from nonstop.scoring.stage import TRANSIENT
from nonstop.types import Group

Sequence_ = tuple[list[int], list[int]]  # (prompt ids, completion ids)


def check_tokenizers(student_dir: str, teacher_dir: str) -> None:
    if not Path(teacher_dir).is_dir():
        raise RewardError(f"distill.teacher: {teacher_dir} is not a folder (a causal LM saved with save_pretrained)")
    student, teacher = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    sv, tv = student.get_vocab(), teacher.get_vocab()
    fix = "the teacher scores the student's token ids as they are: give it the student's tokenizer"
    if sv != tv:
        differ = sorted(t for t in set(sv) | set(tv) if sv.get(t) != tv.get(t))
        raise RewardError(
            f"distill.teacher: {teacher_dir} has another tokenizer than the student's "
            f"({len(tv)} vs {len(sv)} tokens; {len(differ)} map differently, e.g. {differ[:3]}); {fix}"
        )
    for special in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, special) != getattr(teacher, special):
            raise RewardError(
                f"distill.teacher: {special} is {getattr(teacher, special)} for the teacher and "
                f"{getattr(student, special)} for the student; {fix}"
            )
    vocab = AutoConfig.from_pretrained(teacher_dir).vocab_size
    if vocab < len(sv):
        raise RewardError(f"distill.teacher: the teacher's vocab_size {vocab} is below the tokenizer's {len(sv)} ids")


def teacher_identity(cfg: DistillConfig) -> str:
    """'path@version': distill.version, else the first 12 hex digits of the weights' sha256."""
    assert cfg.teacher is not None
    if cfg.version is not None:
        return f"{cfg.teacher}@{cfg.version}"
    h = hashlib.sha256()
    for f in sorted(Path(cfg.teacher).glob("*.safetensors")) + sorted(Path(cfg.teacher).glob("*.bin")):
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return f"{cfg.teacher}@{h.hexdigest()[:12]}"


class TeacherWorker:
    """The teacher actor: a causal LM that scores token ids it did not sample."""

    def __init__(self, path: str, temperature: float, batch_size: int) -> None:
        self.model = load_model(path).eval().requires_grad_(False)
        self.temperature, self.batch_size = temperature, batch_size

    def logprobs(self, seqs: list[Sequence_]) -> list[list[float]]:
        out: list[list[float]] = []
        with torch.no_grad():
            for lo in range(0, len(seqs), self.batch_size):
                chunk = seqs[lo : lo + self.batch_size]
                full = [p + c for p, c in chunk]
                L = max(len(x) for x in full)
                ids = torch.zeros((len(full), L), dtype=torch.long)  # (b, L) right-padded
                attn = torch.zeros((len(full), L), dtype=torch.long)
                for i, x in enumerate(full):
                    ids[i, : len(x)] = torch.tensor(x)
                    attn[i, : len(x)] = 1
                logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()  # (b, L, V)
                logp = torch.log_softmax(logits / self.temperature, dim=-1)
                for i, (p, c) in enumerate(chunk):
                    pos = torch.arange(len(p) - 1, len(p) - 1 + len(c))  # position t - 1 predicts token t
                    out.append(logp[i, pos, torch.tensor(c, dtype=torch.long)].tolist())
        return out


class TeacherComponent:
    name = "teacher"
    retryable = TRANSIENT

    def __init__(
        self,
        cfg: DistillConfig,
        temperature: float,
        backend: ActorBackend,
        log: Callable[[str], None],
        timeout_s: float = 120.0,
    ) -> None:
        assert cfg.teacher is not None
        self.identity = teacher_identity(cfg)
        self.timeout_s = timeout_s
        self.pool = TeacherPool(
            backend,
            "teacher",
            TeacherWorker,
            (cfg.teacher, temperature, cfg.batch_size),
            max_restarts=cfg.max_restarts,
            log=log,
        )
        self.batcher = Batcher("teacher", self._send, cfg.batch_size)

    async def _send(self, seqs: list[Sequence_]) -> list[list[float]]:
        return await self.pool.logprobs(seqs, self.timeout_s)

    async def start(self) -> None:
        await self.pool.start()

    async def contribute(self, group: Group) -> Contribution:
        lps = await self.batcher.submit([(s.prompt_ids, s.completion_ids) for s in group.samples])
        return Contribution(teacher_logprobs=lps, teacher=self.identity)

    async def close(self) -> None:
        await self.batcher.close()
        await self.pool.stop()
