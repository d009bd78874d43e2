"""The worker ``benchmarks/multinode_groups.py`` runs on its ranks: a round trip, a device
all-reduce, a data-parallel function and a sleep, nothing else (its ranks import it as
``benchmarks.bench_worker``; the benchmark puts the repository root on their ``PYTHONPATH``)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.rank.worker import Dispatch, Worker, register


def double_plus(x: torch.Tensor) -> torch.Tensor:
    """What ``double`` computes, row by row: x * 2 + 1."""
    return x * 2 + 1


class BenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def echo(self, *args: object) -> dict:
        return {"args": list(args), "rank": self.rank}

    @register(Dispatch.ONE_TO_ALL)
    def device_allreduce(self) -> dict:
        """all_reduce of (rank + 1) on the worker's device (nccl on a CUDA group)."""
        t = torch.full((4,), float(self.rank + 1), device=self.device)
        dist.all_reduce(t)
        return {"device": str(t.device), "sum": t[0].item(), "backend": str(dist.get_backend())}

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
        dist.barrier()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict(tensors={"y": double_plus(data.batch["x"]), "id": data.batch["id"]})
        dist.barrier()
        return out
