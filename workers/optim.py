"""The optimizer of a sharded model and the step of the PPO loops: AdamW with a linear-warmup LR
schedule, the clipped step that skips a non-finite gradient, the metric sums of a mini-batch over
the ranks, and the optimizer state moved between host and device.

    optimizer, scheduler = build_optimizer(module, cfg.actor.optim)
    metrics = finish_mini_batch(module, optimizer, scheduler, grad_clip, sums, device, "actor")
    with optimizer_state_on(optimizer, cfg.actor.fsdp, device): ...   # fsdp.optimizer_offload

The optimizer's state tensors live where the (sharded) parameters do: on the CPU with
``fsdp.param_offload``; with ``fsdp.optimizer_offload`` alone they wait on the CPU between updates.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import FSDPConfig, OptimConfig

__all__ = [
    "build_optimizer",
    "warmup_lambda",
    "optimizer_kernel",
    "clip_and_step",
    "global_sum",
    "finish_mini_batch",
    "move_optimizer_state",
    "optimizer_state_on",
]


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
        betas=optim_cfg.betas,
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


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer state (sharded or not) to ``device`` (offload/reload)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


@contextlib.contextmanager
def optimizer_state_on(
    optimizer: torch.optim.Optimizer, fsdp_cfg: FSDPConfig, device: torch.device
) -> Iterator[None]:
    """The optimizer state on ``device`` for the block and back on the CPU after it, when
    ``fsdp.optimizer_offload`` keeps it there between updates (nothing to move when the
    parameters themselves are offloaded: the state then lives on the CPU throughout)."""
    offload = fsdp_cfg.optimizer_offload and not fsdp_cfg.param_offload
    if offload:
        move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        if offload:
            move_optimizer_state(optimizer, "cpu")
