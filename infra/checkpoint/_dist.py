"""The few collectives checkpointing needs, safe without a process group (one process)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank_world", "barrier", "all_gather_json"]


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group`` (the default group when None); (0, 1) without one."""
    return (dist.get_rank(group), dist.get_world_size(group)) if _on() else (0, 1)


def barrier(group: Any = None) -> None:
    if _on():
        dist.barrier(group=group)


def _device(group: Any) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device for an NCCL-only group,
    else the CPU (gloo, or ppoflow's ``cpu:gloo,cuda:nccl``)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order, on every rank of ``group``.

    Travels as bytes in tensors, never pickled: ``dist.all_gather_object`` would unpickle what
    other processes send.
    """
    if not _on():
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj).encode()
    world, device = dist.get_world_size(group), _device(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    longest = max(1, int(max(s.item() for s in sizes)))
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(parts, mine.to(device), group=group)
    return [json.loads(p[: int(n.item())].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]
