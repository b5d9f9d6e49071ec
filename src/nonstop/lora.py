"""LoRA adapters: the math and names shared by the trainer (peft) and the engine (merge).

Contract:
- adapter tensor names are the targeted module's path in the plain transformers model plus
  `.lora_A.weight` (r, in_features) or `.lora_B.weight` (out_features, r) — the keys of a
  peft adapter file without peft's `base_model.model.` prefix and adapter name;
- a module is targeted when its path equals an entry of `target_modules` or ends with
  `.` + that entry (peft's rule for a list); it must be a `torch.nn.Linear` whose weight is
  not tied to another module (a tied lm_head would drag the embedding along when merged);
- the effective weight is W = W0 + (alpha / r) * B @ A (peft's default scaling).

Trainer side (`wrap_with_peft`, `adapter_tensors`) imports peft lazily; the engine side
(`MergedAdapters`) needs only torch: it keeps a private copy W0 of every targeted weight
and, after each adapter update, rewrites W in place, so decoding runs the plain model at
unchanged speed and the base weights never travel again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from nonstop.config import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

ADAPTER = "default"  # peft's adapter name; it never appears in our tensor names


def targeted_modules(model: torch.nn.Module, cfg: LoraConfig) -> list[tuple[str, torch.nn.Linear]]:
    """(path, module) of every module LoRA applies to, in `named_modules` order."""
    found = []
    owners: dict[int, list[str]] = {}  # a weight tensor's storage -> modules using it (tied weights)
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(p.data_ptr(), []).append(f"{name}.{pname}")
    for name, module in model.named_modules():
        if not any(name == t or name.endswith(f".{t}") for t in cfg.target_modules):
            continue
        if not isinstance(module, torch.nn.Linear):
            raise ValueError(
                f"model.lora.target_modules: {name} is a {type(module).__name__}, "
                "only torch.nn.Linear modules can be adapted"
            )
        tied = owners[module.weight.data_ptr()]
        if len(tied) > 1:  # merging into it would change the other module too; peft adapts only this one
            raise ValueError(
                f"model.lora.target_modules: {name}.weight is tied to "
                f"{', '.join(t for t in tied if not t.startswith(name + '.'))}; "
                "tied weights cannot be adapted"
            )
        found.append((name, module))
    if not found:
        raise ValueError(f"model.lora.target_modules: none of {list(cfg.target_modules)} matches a module of the model")
    return found


def scaling(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def merge_into(weight: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    """weight (out, in) <- base (out, in) + scale * b (out, r) @ a (r, in), in place."""
    torch.addmm(base, b.to(base.dtype), a.to(base.dtype), alpha=scale, out=weight)


class MergedAdapters:
    """Engine side: adapter tensors to receive, and the merge into the targeted weights.

    `tensors()` are zero-initialised A and B for every targeted module (B = 0 is peft's
    initialisation, so the model starts as its base); a transport writes or re-points them,
    then calls `applied()`, which merges them into the live weights."""

    def __init__(self, model: torch.nn.Module, cfg: LoraConfig, dtype: torch.dtype | None = None) -> None:
        """`dtype`: the adapters' own, as they travel (default: the model's); the kept base copies and
        the merged weights stay in the model's dtype."""
        self.scale = scaling(cfg)
        self.merge_s = 0.0  # total time spent merging, for the engine's stats and the benchmark
        self.entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.named: list[tuple[str, torch.Tensor]] = []
        with torch.no_grad():
            for name, module in targeted_modules(model, cfg):
                w = module.weight
                a = torch.zeros((cfg.rank, module.in_features), dtype=dtype or w.dtype)
                b = torch.zeros((module.out_features, cfg.rank), dtype=dtype or w.dtype)
                self.entries.append((w, w.detach().clone(), a, b))
                self.named += [(f"{name}.lora_A.weight", a), (f"{name}.lora_B.weight", b)]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    @torch.no_grad()
    def applied(self) -> None:
        # A transport may have re-pointed A and B (replaced their .data); the objects stay the same.
        t0 = time.perf_counter()
        for w, base, a, b in self.entries:
            merge_into(w.data, base, a, b, self.scale)
        self.merge_s += time.perf_counter() - t0


def wrap_with_peft(model: PreTrainedModel, cfg: LoraConfig, adapter_dir: str | None = None) -> PeftModel:
    """Trainer side: a peft model whose only trainable parameters are the adapters, freshly
    initialised or loaded from a peft adapter folder (a checkpoint's `model/`)."""
    import peft  # optional: peft, the lora extra (model.lora)

    targeted_modules(model, cfg)  # the same matching rule as the engine, with its errors
    if adapter_dir is not None:
        return peft.PeftModel.from_pretrained(model, adapter_dir, adapter_name=ADAPTER, is_trainable=True)
    # peft annotates lora_alpha as int, yet scales by lora_alpha / r in floating point: a fractional alpha works.
    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        init_lora_weights=True,
    )
    return peft.get_peft_model(model, peft_cfg, adapter_name=ADAPTER)


def adapter_tensors(peft_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Trainer side: (name, parameter) of every adapter tensor, named as `MergedAdapters` names them."""
    from peft.tuners.lora import LoraLayer  # optional: peft, the lora extra

    tuner: Any = peft_model.base_model  # a peft model's tuner, found by name (nn.Module types it Tensor | Module)
    out: list[tuple[str, torch.Tensor]] = []
    for name, module in tuner.model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            out += [
                (f"{name}.lora_A.weight", _linear_weight(module.lora_A[ADAPTER])),
                (f"{name}.lora_B.weight", _linear_weight(module.lora_B[ADAPTER])),
            ]
    return out


def _linear_weight(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # peft's lora_A / lora_B of a Linear target are Linear layers
    return weight
