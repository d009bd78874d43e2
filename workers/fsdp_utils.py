"""FSDP2 plumbing shared by the actor, reference and critic: mesh, model loading, sharding,
optimizer, full-parameter streaming and the optimizer-step helpers of the PPO loops.

    mesh = build_mesh(cfg.actor.fsdp, world_size, "cpu")        # ("fsdp",) or ("replicate", "shard")
    hf = load_hf_model(cfg.model, "causal_lm")                    # on CPU, every rank
    module = apply_fsdp(PolicyLM(hf), mesh, cfg.actor.fsdp, device)
    optimizer, scheduler = build_optimizer(module, cfg.actor.optim)
    for name, tensor in iter_full_params(module): ...             # HF names, one full tensor at a time

Mixed precision (``FSDPConfig.param_dtype`` / ``reduce_dtype``):
- CPU + gloo: ``param_dtype`` None/float32 or bfloat16 with ``reduce_dtype`` float32 work
  (bf16 compute on CPU is slow; use it to test the dtype path, not for speed). float16 compute
  is not supported by many CPU kernels: do not use it on CPU.
- CUDA + NCCL: ``param_dtype=bfloat16, reduce_dtype=float32`` with float32 master parameters
  (``model.dtype=float32``) is the recommended setting; everything else works as well.
``param_offload`` uses ``CPUOffloadPolicy`` (``pin_memory`` only on CUDA: pinning fails on CPU-only
builds). The optimizer state then lives on the CPU too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from ppoflow.workers.compiled import compile_decoder_layers
from ppoflow.workers.packing import use_varlen_attention

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import FSDPConfig, ModelConfig, OptimConfig

__all__ = [
    "MODEL_KINDS",
    "build_mesh",
    "load_hf_model",
    "model_from_config",
    "apply_fsdp",
    "build_fsdp_model",
    "enable_gradient_checkpointing",
    "reshard_all",
    "iter_full_params",
    "build_optimizer",
    "warmup_lambda",
    "clip_and_step",
    "optimizer_kernel",
    "global_sum",
    "move_optimizer_state",
]

MODEL_KINDS = ("causal_lm", "token_classification", "sequence_classification")
# Prefixes added by wrappers (activation checkpointing, torch.compile, FSDP1): never part of an HF name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _dtype(name: str | None) -> torch.dtype | None:
    """'bfloat16' -> torch.bfloat16; None stays None."""
    return None if name is None else getattr(torch, name)


def build_mesh(fsdp_cfg: FSDPConfig, world_size: int, device_type: str) -> DeviceMesh:
    """The device mesh FSDP shards over.

    ``fsdp_size`` -1 or equal to the world: a 1-D mesh ``("fsdp",)`` of size world (plain FSDP).
    Otherwise a 2-D mesh ``("replicate", "shard")`` of shape (world / fsdp_size, fsdp_size):
    hybrid sharding (HSDP) — parameters sharded inside each group of ``fsdp_size`` consecutive
    ranks, replicated across groups; gradients reduce-scattered in a group, all-reduced across.
    """
    size = fsdp_cfg.fsdp_size
    if size == -1 or size == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if size < 1 or world_size % size:
        raise ValueError(f"fsdp_size={size} must be -1 or a divisor of the world size {world_size}")
    return init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=("replicate", "shard"))


def _auto_class(kind: str):
    """The transformers Auto class of a model kind."""
    import transformers

    classes = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_classification": transformers.AutoModelForTokenClassification,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }
    if kind not in classes:
        raise ValueError(f"unknown model kind {kind!r}; allowed: {', '.join(MODEL_KINDS)}")
    return classes[kind]


def _kind_overrides(kind: str) -> dict[str, Any]:
    """Config fields a kind forces: the critic is a one-label token classifier without dropout
    (the default head dropout is 0.1, which would make values non-deterministic)."""
    if kind == "token_classification":
        return {"num_labels": 1, "classifier_dropout": 0.0}
    return {}


def _hf_config(model_cfg: ModelConfig, kind: str):
    """The model's transformers config with ``override_config`` and the kind's forced fields."""
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(
        model_cfg.path, trust_remote_code=bool(model_cfg.trust_remote_code)
    )
    for key, value in {**model_cfg.override_config, **_kind_overrides(kind)}.items():
        setattr(hf_cfg, key, value)
    return hf_cfg


def load_hf_model(model_cfg: ModelConfig, kind: str, dtype: str | None = None) -> nn.Module:
    """Load a Hugging Face model on the CPU with ``from_pretrained`` (a full copy: the workers call
    it on rank 0 only, through ``build_fsdp_model``). A head the checkpoint lacks (a critic's
    ``score`` on top of a causal LM) is initialised from torch's global RNG.

    ``trust_remote_code`` comes only from ``model_cfg``; ``override_config`` is applied to the
    loaded config. Returns the model in eval mode (callers switch to train mode to update).
    """
    trust = bool(model_cfg.trust_remote_code)
    model = _auto_class(kind).from_pretrained(
        model_cfg.path,
        config=_hf_config(model_cfg, kind),
        trust_remote_code=trust,
        dtype=_dtype(dtype or model_cfg.dtype),
    )
    model.eval()
    return model


def model_from_config(
    hf_cfg, kind: str, dtype: str = "float32", trust_remote_code: bool = False
) -> nn.Module:
    """A randomly initialised model of ``kind`` from a transformers config (benchmarks, tests)."""
    for key, value in _kind_overrides(kind).items():
        setattr(hf_cfg, key, value)
    model = _auto_class(kind).from_config(hf_cfg, dtype=_dtype(dtype), trust_remote_code=trust_remote_code)
    model.eval()
    return model


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers for real (rotary
    ``inv_freq`` and other non-persistent buffers are computed, not loaded: they must exist).
    Patches ``nn.Module.register_parameter`` for the duration: build nothing else meanwhile."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_fsdp_model(
    model_cfg: ModelConfig,
    kind: str,
    wrap: Callable[[nn.Module], nn.Module],
    mesh: DeviceMesh,
    fsdp_cfg: FSDPConfig,
    device: torch.device | str,
    *,
    trainable: bool = True,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    varlen_attention: bool = False,
) -> nn.Module:
    """Sharded model with the checkpoint's weights, read by rank 0 only.

    Every rank builds the model with meta parameters, wraps it (``wrap(hf_model)``, e.g.
    ``PolicyLM``) and shards it; rank 0 alone loads the checkpoint (``load_hf_model``, heads the
    checkpoint lacks initialised from ``seed``) and ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` sends each rank its shards. Host memory: one full copy on rank 0
    instead of one per rank. Buffers (rotary ``inv_freq``) are saved before ``to_empty`` and put
    back after it: ``to_empty`` leaves them uninitialised (silently wrong logits otherwise).
    ``varlen_attention`` switches the model to ``ppoflow_varlen`` attention (packed forwards).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = torch.device(device)
    with _parameters_on_meta():
        hf = model_from_config(
            _hf_config(model_cfg, kind),
            kind,
            dtype=model_cfg.dtype,
            trust_remote_code=bool(model_cfg.trust_remote_code),
        )
    if varlen_attention:
        use_varlen_attention(hf)
    if gradient_checkpointing:
        enable_gradient_checkpointing(hf)
    if getattr(model_cfg, "use_torch_compile", False):
        compile_decoder_layers(hf, _decoder_layers(hf))
    hf.requires_grad_(trainable)
    module = wrap(hf)
    buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    apply_fsdp(module, mesh, fsdp_cfg, device)
    module.to_empty(device="cpu" if fsdp_cfg.param_offload else device)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
    full: dict[str, torch.Tensor] = {}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.manual_seed(seed)
        full = wrap(load_hf_model(model_cfg, kind)).state_dict()
    set_model_state_dict(
        module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full
    _copy_generation_config(model_cfg, hf)
    module.eval()
    return module


def _copy_generation_config(model_cfg: ModelConfig, hf: nn.Module) -> None:
    """Give a model built from its config the checkpoint's ``generation_config.json`` (stop ids, ...)."""
    if getattr(hf, "generation_config", None) is None:
        return
    try:
        from transformers import GenerationConfig

        hf.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
    except (OSError, ValueError):
        pass


def _decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class is in the HF model's ``_no_split_modules``."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or [])
    config = getattr(module, "config", None)
    if not names and config is not None:
        raise ValueError(
            f"{type(module).__name__} declares no _no_split_modules: cannot find its decoder layers"
        )
    return [m for m in module.modules() if type(m).__name__ in names]


def enable_gradient_checkpointing(hf_model: nn.Module) -> None:
    """Recompute each decoder layer in backward (HF's non-reentrant checkpointing; only active in
    train mode). Composes with FSDP2: its hooks skip re-gathering during the recompute."""
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(hf_model, "config"):
        hf_model.config.use_cache = False


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    fsdp_cfg: FSDPConfig,
    device: torch.device | str,
    layers: list[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``module`` with FSDP2: ``fully_shard`` on each decoder layer, then on the root.

    The root owns everything outside the layers: embeddings, final norm and the (tied) LM head —
    wrapping the tied embedding separately raises. Mixed precision is
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` from ``fsdp_cfg`` (param_dtype None = the
    parameters' own dtype). ``param_offload`` keeps sharded parameters (and so gradients and
    optimizer state) on the CPU. Without offload the shards move to ``device`` (meta parameters
    stay meta: ``to_empty`` + a state dict load follow, see ``build_fsdp_model``).

    Args:
        module: the model (e.g. ``ppoflow.workers.modeling.PolicyLM``); parameters on the CPU or ``device``.
        layers: the blocks to shard one by one; default: the classes in ``_no_split_modules``.

    Returns:
        the same module, now an ``FSDPModule``.
    """
    device = torch.device(device)
    mp = MixedPrecisionPolicy(
        param_dtype=_dtype(fsdp_cfg.param_dtype), reduce_dtype=_dtype(fsdp_cfg.reduce_dtype)
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp_cfg.param_offload else OffloadPolicy()
    )
    on_meta = any(p.is_meta for p in module.parameters())
    if not fsdp_cfg.param_offload and device.type != "cpu" and not on_meta:
        module.to(device)
    for layer in layers if layers is not None else _decoder_layers(module):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=fsdp_cfg.reshard_after_forward,
        )
    fully_shard(
        module,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=fsdp_cfg.reshard_after_forward,
    )
    return module


def reshard_all(module: nn.Module) -> None:
    """Free every unsharded parameter (e.g. the root's, which FSDP keeps after a no-grad forward)."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def hf_name(name: str) -> str:
    """Strip wrapper prefixes from a parameter name: the name the HF checkpoint and vLLM use."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _full(param: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter; collective across the mesh for DTensors."""
    if not isinstance(param, DTensor):
        return param.detach()
    local = param.to_local()
    mesh_device = param.device_mesh.device_type
    if param.device_mesh.size() == 1 and local.shape == param.shape:
        # a one-rank mesh: the shard is the whole tensor (no collective: ~8x less per parameter)
        return (local if local.device.type == mesh_device else local.to(device or mesh_device)).detach()
    if local.device.type != mesh_device:  # CPU-offloaded shard on a CUDA mesh: gather on the GPU
        local = local.to(device if device is not None else mesh_device)
        param = DTensor.from_local(
            local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return param.full_tensor().detach()


def iter_full_params(
    module: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for each parameter, one at a time (peak memory: one full
    parameter). Tied parameters appear once, under the name the HF checkpoint stores them
    (``model.embed_tokens.weight``; no ``lm_head.weight`` for tied models).

    Collective: every rank of the mesh must iterate to the end, in the same order.
    """
    reshard_all(module)
    for name, param in module.named_parameters():
        full = _full(param, device)
        yield hf_name(name), (full if dtype is None else full.to(dtype))


def warmup_lambda(warmup_steps: int):
    """LR multiplier for optimizer step ``s`` (0-based): ``min(1, (s + 1) / warmup_steps)``, so
    the first step already moves and the full LR is reached at step ``warmup_steps - 1``."""

    def fn(step: int) -> float:
        if warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / warmup_steps)

    return fn


def build_optimizer(
    module: nn.Module, optim_cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters and a LambdaLR with linear warmup, then constant.

    Warmup length: ``warmup_steps`` if > 0, else ``warmup_steps_ratio * total_training_steps``.
    ``optim_cfg.fused``: True = AdamW's fused kernel (one kernel for all parameters; works on
    FSDP2's DTensor shards, CUDA and CPU), False = torch's default (foreach on CUDA, a loop over
    parameters on CPU), None = fused when the parameters are on CUDA.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    fused = optim_cfg.fused
    if fused is None:
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=optim_cfg.lr,
        betas=tuple(optim_cfg.betas),
        eps=optim_cfg.eps,
        weight_decay=optim_cfg.weight_decay,
        fused=True if fused else None,
    )
    warmup = optim_cfg.warmup_steps
    if warmup <= 0 and optim_cfg.warmup_steps_ratio > 0:
        if not optim_cfg.total_training_steps:
            raise ValueError("optim.warmup_steps_ratio needs optim.total_training_steps")
        warmup = int(optim_cfg.warmup_steps_ratio * optim_cfg.total_training_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup))
    return optimizer, scheduler


def optimizer_kernel(optimizer: torch.optim.Optimizer) -> str:
    """Which AdamW kernel ``optimizer`` runs: ``fused``, ``foreach`` or ``for-loop`` (torch's
    default picks foreach for CUDA tensors, FSDP2's DTensors included, and the loop on CPU)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    group = optimizer.param_groups[0]
    if group.get("fused"):
        return "fused"
    if group.get("foreach") is None:
        _, foreach = _default_to_fused_or_foreach(group["params"], differentiable=False, use_fused=False)
        return "foreach" if foreach else "for-loop"
    return "foreach" if group["foreach"] else "for-loop"


def clip_and_step(
    module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, max_norm: float
) -> tuple[float, bool]:
    """Clip the global gradient norm, then step optimizer and scheduler unless the norm is
    non-finite (the step is skipped and the gradients dropped). ``max_norm <= 0`` only measures.

    Returns:
        ``(grad_norm, stepped)``; ``grad_norm`` is the norm before clipping.
    """
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    norm_value = float(norm)
    stepped = math.isfinite(norm_value)
    if stepped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm_value, stepped


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """All-reduce (sum) a few floats over the default group, in float64."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer state (sharded or not) to ``device`` (offload/reload)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def mesh_info(mesh: DeviceMesh, module: nn.Module) -> dict[str, Any]:
    """JSON description of the sharding: mesh shape and dim names, placements of a parameter,
    number of parameters (full) and of local (sharded) elements on this rank."""
    first = next(iter(module.parameters()), None)
    placements = [repr(p) for p in first.placements] if isinstance(first, DTensor) else []
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        "placements": placements,
        "num_params": sum(p.numel() for p in module.parameters()),
        "local_numel": local,
    }


def finish_mini_batch(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    grad_clip: float,
    sums: dict[str, float],
    device: torch.device,
    prefix: str,
) -> dict[str, float]:
    """End of one mini-batch: sum the weighted metric ``sums`` over ranks, then clip and step.

    Returns the summed metrics plus ``<prefix>/grad_norm``, ``<prefix>/lr`` (the LR this step used)
    and ``<prefix>/skipped_steps`` (1.0 when a non-finite gradient norm skipped the step).
    """
    keys = sorted(sums)
    reduced = dict(zip(keys, global_sum([sums[k] for k in keys], device)))
    lr = optimizer.param_groups[0]["lr"]
    grad_norm, stepped = clip_and_step(module, optimizer, scheduler, grad_clip)
    return {
        **reduced,
        f"{prefix}/grad_norm": grad_norm,
        f"{prefix}/lr": lr,
        f"{prefix}/skipped_steps": float(not stepped),
    }
