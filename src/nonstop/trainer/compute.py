"""The bf16 step's weights: float32 masters cast to bfloat16 once per optimizer step, not once per forward.

Under `torch.autocast` every autocast region casts each float32 weight a matmul reads: once per region
for weights that train (autocast's cache), at every use for frozen ones (a LoRA base, the KL reference),
and the fused LM head (logprobs.py) casts its weight itself in its forward and again in its backward. The
worker runs a step and each forward it runs ahead in separate regions, and the publish casts all weights
once more into the transport's bfloat16. Worse, a cached cast outlives an in-place optimizer step inside
its region, so the later updates of `trainer.updates_per_batch` > 1 read the weights as they were before
the first (the trainer clears the cache after every optimizer step, trainer/core.py).

`ComputeWeights` keeps one bfloat16 copy of every parameter, refreshed right after each optimizer step:
one cast serves every forward until the next step (the step's micro-batches, its later updates, the next
batch's forward run ahead) and the publish (`published()`: the weights as the transport sends them in
bfloat16, no second cast; the transport may re-home the copies into its send buffer, the refresh then
writes straight into it). While `swapped()`, every `nn.Linear` module (the LM head included) holds the
copies of its weight and bias, so the matmuls read bfloat16 directly. Their gradients arrive in bfloat16
and are added into the float32 master's `.grad` as each backward produces them (a post-accumulate hook),
so gradient accumulation across micro-batches, the clip and AdamW stay float32, as under autocast alone.
Embeddings, norms and other weights stay float32 in the forward, as autocast keeps them; a tied embedding
is read in float32 by its lookup and in bfloat16 by the head. The arithmetic is autocast's: the same
round-to-nearest casts of the same float32 values, the same bfloat16 matmuls, the gradients cast to
float32 before they are summed (tests/trainer/test_compute_weights.py).

Single-rank trainers only: DDP and FSDP2 hook the parameters the model holds, so their ranks keep
autocast alone (trainer/parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch


def _fold(master: torch.Tensor, copy: torch.Tensor) -> None:
    """Add the bfloat16 gradient `copy` just received into `master.grad` (float32), and drop it."""
    grad = copy.grad
    if grad is None:
        return
    if master.grad is None:
        master.grad = grad.to(master.dtype)
    else:
        master.grad.add_(grad)
    copy.grad = None


class Published(torch.nn.Module):
    """What the transport packs instead of the model: its named parameters, each as its bfloat16 copy."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.named = named

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, torch.nn.Parameter]]:
        yield from self.named  # type: ignore[misc]


class ComputeWeights:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.model = model
        self.copies: dict[int, torch.nn.Parameter] = {}  # by id of the master (a shared parameter once)
        self.masters: list[torch.nn.Parameter] = []
        for p in model.parameters():
            if p.dtype != torch.float32:
                continue
            copy = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            if p.requires_grad:
                copy.register_post_accumulate_grad_hook(partial(_fold, p))
            self.copies[id(p)] = copy
            self.masters.append(p)
        # (module, name, master, copy) of every Linear's weight and bias: what `swapped()` exchanges
        self.slots = [
            (m, name, p, self.copies[id(p)])
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
            for name, p in m._parameters.items()
            if p is not None and id(p) in self.copies
        ]
        self.refreshes = 0
        self._published: Published | None = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the trainable masters into their copies (after an optimizer step); frozen ones were cast once."""
        trained: list[torch.Tensor] = [p for p in self.masters if p.requires_grad]
        if trained:
            copies: list[torch.Tensor] = [self.copies[id(p)] for p in trained]
            torch._foreach_copy_(copies, trained)
        self.refreshes += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Every Linear module holds the bfloat16 copies of its parameters inside; the masters after."""
        for m, name, _, copy in self.slots:
            m._parameters[name] = copy
        try:
            yield
        finally:
            for m, name, master, _ in self.slots:
                m._parameters[name] = master

    def published(self) -> Published:
        """The model's named parameters as bfloat16 copies of the current weights (tied ones once); the same
        object every time, so the transport looks its tensors up once."""
        if self._published is None:
            self._published = Published([(n, self.copies.get(id(p), p)) for n, p in self.model.named_parameters()])
        return self._published


def cast_linears(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every Linear module of a frozen model (the KL reference) its own `dtype` weight and bias, cast
    once: autocast would cast them again at each forward (it caches casts of trained weights only). A head
    tied to the embedding gets its own copy; the embedding stays as it is, as autocast reads it."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                for name, p in list(m._parameters.items()):
                    if p is not None and p.dtype == torch.float32:
                        m._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
