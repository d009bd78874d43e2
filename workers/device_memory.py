"""GPU memory of one rank: peaks per phase of a call, what vLLM's sleep-mode pool holds, and giving
the caching allocator's spare blocks back before another allocator needs the memory.

    with PeakMemory(device) as gen:
        ...                                   # e.g. a rollout with the engine awake
    metrics["perf/mem/generate_gib"] = gen.gib

Every figure is this process's own (the rank), in GiB, and 0.0 / {} off CUDA, so CPU runs carry no
memory metrics. They come from torch's caching allocator (``max_memory_reserved``: what the
process holds from the device, cached blocks included; not the CUDA context, cuBLAS workspaces or
NCCL buffers, a few hundred MiB more). vLLM's sleep-mode pool (``CuMemAllocator``: the engine's
weights and KV cache) is allocated through torch, so torch keeps counting it as reserved while the
engine sleeps and its physical pages are unmapped; :class:`PeakMemory` subtracts the part that is
asleep when the phase ends, so a phase run entirely asleep or entirely awake is measured right.

Colocated processes on one GPU (the actor group's rank, the critic's, the reward model's) each keep
their caching allocator's spare blocks until told otherwise: :func:`release_cached` gives them back
(``torch.cuda.empty_cache``) after a training step of a group that shares the GPU with an engine,
and :func:`release_for_wake` before vLLM maps its pool again when the pool would not fit otherwise.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["PeakMemory", "release_cached", "release_for_wake", "engine_pool_bytes", "resident_gib", "GIB"]

GIB = float(2**30)


def _cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def release_cached(device: Any) -> None:
    """Return the caching allocator's unused blocks to the device (no-op off CUDA)."""
    if _cuda(device):
        torch.cuda.empty_cache()


def release_for_wake(device: Any, headroom_bytes: int = 2 * 2**30) -> bool:
    """Before the engine maps its sleeping pool again: give the caching allocator's unused blocks
    back only if the device's free memory (every process counted) is short of the pool plus
    ``headroom_bytes`` (at least 5% of the device) for the rollout's own activations. Emptying the
    cache costs tens of milliseconds after a training step, and the blocks kept
    serve the old log-probs and the update that follow. Returns True if it released."""
    if not _cuda(device):
        return False
    need = engine_pool_bytes().get("asleep", 0)
    free, total = torch.cuda.mem_get_info(device)
    if free >= need + max(headroom_bytes, total // 20):
        return False
    torch.cuda.empty_cache()
    return True


def engine_pool_bytes() -> dict[str, int]:
    """Bytes in vLLM's sleep-mode pool of this process, by tag (``weights``, ``kv_cache``), plus
    ``asleep``: the part currently unmapped. {} when no engine with sleep mode lives here (vLLM is
    never imported by this function)."""
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    instance = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if instance is None:
        return {}
    out: dict[str, int] = {"asleep": 0}
    for data in list(getattr(instance, "pointer_to_data", {}).values()):
        size = int(data.handle[1])
        out[data.tag] = out.get(data.tag, 0) + size
        if getattr(data, "is_asleep", False):
            out["asleep"] += size
    return out


def resident_gib(device: Any) -> float:
    """Live tensors of this process now (model, optimizer state, ...), without a sleeping engine."""
    if not _cuda(device):
        return 0.0
    return (torch.cuda.memory_allocated(device) - engine_pool_bytes().get("asleep", 0)) / GIB


class PeakMemory:
    """Peak device memory this process held during a block (``gib``), see the module docstring.

    The engine should not change between asleep and awake inside the block: the sleeping part is
    read when the block ends.
    """

    def __init__(self, device: Any):
        self.device = torch.device(device)
        self.on = _cuda(self.device)
        self.gib = 0.0

    def __enter__(self) -> PeakMemory:
        if self.on:
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            peak = torch.cuda.max_memory_reserved(self.device)
            self.gib = (peak - engine_pool_bytes().get("asleep", 0)) / GIB
