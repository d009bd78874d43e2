"""The FSDP2-sharded model shared by the actor, reference, critic and reward model: the device
mesh, the sharding (of a model in memory, or built on meta and filled from rank 0's checkpoint
copy), and the full parameters read back one at a time.

    mesh = build_mesh(cfg.actor.fsdp, world_size, "cpu")        # ("fsdp",) or ("replicate", "shard")
    hf = load_hf_model(cfg.model, "causal_lm")                    # ppoflow.workers.hf_models
    module = apply_fsdp(PolicyLM(hf), mesh, cfg.actor.fsdp, device)
    for name, tensor in iter_full_params(module): ...             # HF names, one full tensor at a time

The Hugging Face models themselves (kinds, loading) are in ``ppoflow.workers.hf_models``; the
optimizer of a sharded module and the PPO loops' step in ``ppoflow.workers.optim``.

Mixed precision (``FSDPConfig.param_dtype`` / ``reduce_dtype``):
- CPU + gloo: ``param_dtype`` None/float32 or bfloat16 with ``reduce_dtype`` float32 work
  (bf16 compute on CPU is slow; use it to test the dtype path, not for speed). float16 compute
  is not supported by many CPU kernels: do not use it on CPU.
- CUDA + NCCL: ``param_dtype=bfloat16, reduce_dtype=float32`` with float32 master parameters
  (``model.dtype=float32``) is the recommended setting; everything else works as well.
``param_offload`` uses ``CPUOffloadPolicy`` (``pin_memory`` only on CUDA: pinning fails on CPU-only
builds). The optimizer state then lives on the CPU too (``ppoflow.workers.optim``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

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
from ppoflow.workers.hf_models import (
    copy_generation_config,
    decoder_layers,
    enable_gradient_checkpointing,
    hf_config,
    load_hf_model,
    model_from_config,
    torch_dtype,
)

# Moved to ppoflow.workers.optim; importable from here too while tests/support imports it (and
# ``load_hf_model``, imported above) from this module.
from ppoflow.workers.packing import use_varlen_attention

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from transformers import PreTrainedModel

    from ppoflow.infra.config import FSDPConfig, ModelConfig

M = TypeVar("M", bound=nn.Module)  # the wrapper build_fsdp_model puts around the HF model

__all__ = [
    "build_mesh",
    "apply_fsdp",
    "build_fsdp_model",
    "reshard_all",
    "mesh_info",
    "hf_name",
    "local_shard",
    "full_param",
    "iter_full_params",
]

# Prefixes added by wrappers (activation checkpointing, torch.compile, FSDP1): never part of an HF name.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


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

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]  # the patch, on purpose
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_fsdp_model(
    model_cfg: ModelConfig,
    kind: str,
    wrap: Callable[[PreTrainedModel], M],
    mesh: DeviceMesh,
    fsdp_cfg: FSDPConfig,
    device: torch.device | str,
    *,
    trainable: bool = True,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    varlen_attention: bool = False,
) -> M:
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
            hf_config(model_cfg, kind),
            kind,
            dtype=model_cfg.dtype,
            trust_remote_code=bool(model_cfg.trust_remote_code),
        )
    if varlen_attention:
        use_varlen_attention(hf)
    if gradient_checkpointing:
        enable_gradient_checkpointing(hf)
    if getattr(model_cfg, "use_torch_compile", False):
        compile_decoder_layers(hf, decoder_layers(hf))
    hf.requires_grad_(trainable)
    module = wrap(hf)
    buffers = {name: buf.detach().clone() for name, buf in module.named_buffers()}
    apply_fsdp(module, mesh, fsdp_cfg, device)
    module.to_empty(device="cpu" if fsdp_cfg.param_offload else device)
    with torch.no_grad():
        for name, buf in module.named_buffers():
            buf.copy_(buffers[name].to(buf.device))
    full: dict[str, Any] = {}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.manual_seed(seed)
        full = wrap(load_hf_model(model_cfg, kind)).state_dict()
    set_model_state_dict(
        module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    del full
    copy_generation_config(model_cfg, hf)
    module.eval()
    return module


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
        param_dtype=torch_dtype(fsdp_cfg.param_dtype), reduce_dtype=torch_dtype(fsdp_cfg.reduce_dtype)
    )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp_cfg.param_offload else OffloadPolicy()
    )
    on_meta = any(p.is_meta for p in module.parameters())
    if not fsdp_cfg.param_offload and device.type != "cpu" and not on_meta:
        module.to(device)
    blocks = layers if layers is not None else decoder_layers(module)
    for target in [*blocks, module]:  # the layers first, the root last
        fully_shard(
            target,
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


def local_shard(param: DTensor, device: torch.device | None = None) -> torch.Tensor:
    """This rank's shard of a DTensor on its mesh's device type: a CPU-offloaded shard of a CUDA
    mesh is copied to ``device`` (default: the current CUDA device), where the collectives run."""
    local = param.to_local()
    mesh_device = param.device_mesh.device_type
    if local.device.type != mesh_device:
        local = local.to(device if device is not None else mesh_device)
    return local


def full_param(param: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The full tensor of a (possibly sharded) parameter; collective across the mesh for DTensors
    (on the mesh's device, see ``local_shard``)."""
    if not isinstance(param, DTensor):
        return param.detach()
    offloaded = param.to_local().device.type != param.device_mesh.device_type
    local = local_shard(param, device)
    if param.device_mesh.size() == 1 and local.shape == param.shape:
        # a one-rank mesh: the shard is the whole tensor (no collective per parameter)
        return local.detach()
    if offloaded:
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
        full = full_param(param, device)
        yield hf_name(name), (full if dtype is None else full.to(dtype))


def mesh_info(mesh: DeviceMesh, module: nn.Module) -> dict[str, Any]:
    """JSON description of the sharding: mesh shape and dim names, placements of a parameter,
    number of parameters (full) and of local (sharded) elements on this rank."""
    first = next(iter(module.parameters()), None)
    placements: list[str] = [repr(p) for p in first.placements] if isinstance(first, DTensor) else []
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names or ()),
        "placements": placements,
        "num_params": sum(p.numel() for p in module.parameters()),
        "local_numel": local,
    }
