"""Toy workers for tests/infra/remote/driver/test_group.py: real gloo collectives and DataProto I/O, no models."""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch
import torch.distributed as dist

from ppoflow.infra.remote.rank.worker import Dispatch, MetricRule, Worker, register

#: The pid of the process that imported this module.
IMPORTED_IN = os.getpid()


def double_plus(x: torch.Tensor) -> torch.Tensor:
    """The rank-independent function the DP tests compare against: x * 2 + 1."""
    return x * 2 + 1


class ToyWorker(Worker):
    """Methods covering every dispatch mode and every failure the group must survive or report."""

    def __init__(self, config: dict):
        super().__init__(config)
        self.calls = 0
        if config.get("fail_in_init_on_rank") == self.rank:
            raise ValueError(f"init failure requested for rank {self.rank}")

    @register(Dispatch.ONE_TO_ALL)
    def info(self) -> dict:
        """Rank facts plus a gloo all_reduce of (rank + 1)."""
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "device": str(self.device),
            "pid": os.getpid(),
            "allreduce": t.item(),
            "threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "config": self.config,
        }

    @register(Dispatch.ONE_TO_ALL)
    def process(self) -> dict:
        """This rank's process: its parent, its command line, and the process that imported this
        module (the rank itself, or the launcher it was forked from)."""
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            cmdline = f.read().decode().split("\0")
        preloaded = sys.modules.get("tests.support.preloaded")  # if the group's launcher preloaded it
        return {
            "ppid": os.getppid(),
            "cmdline": cmdline,
            "imported_in": IMPORTED_IN,
            "preloaded_in": getattr(preloaded, "IMPORTED_IN", None),
        }

    @register(Dispatch.ONE_TO_ALL)
    def device_allreduce(self) -> dict:
        """all_reduce of (rank + 1) on the worker's device (nccl on a CUDA group)."""
        t = torch.full((4,), float(self.rank + 1), device=self.device)
        dist.all_reduce(t)
        return {"device": str(t.device), "sum": t[0].item(), "backend": str(dist.get_backend())}

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, *args, **kwargs) -> dict:
        """Return the JSON args as received."""
        self.calls += 1
        return {"args": list(args), "kwargs": kwargs, "rank": self.rank}

    @register(Dispatch.RANK_ZERO)
    def count(self) -> int:
        """Number of echo calls seen by this rank (only rank 0's comes back)."""
        return self.calls + 1000 * self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail(
        self, rank: int, in_collective: bool = False, busy_rank: int | None = None, busy_s: float = 0.0
    ) -> None:
        """``rank`` raises; ``busy_rank`` first sleeps ``busy_s`` (deaf to the driver); with
        ``in_collective`` the other ranks then wait in an all_reduce that never completes."""
        if self.rank == rank:
            raise ValueError(f"toy failure on rank {rank}")
        if self.rank == busy_rank:
            time.sleep(busy_s)
        if in_collective:
            dist.all_reduce(torch.ones(1, device=self.device))

    @register(Dispatch.ONE_TO_ALL)
    def raise_error(self, rank: int, error: str, message: str) -> None:
        """``rank`` raises the exception class ``error`` ("module:Class") with ``message``."""
        if self.rank == rank:
            module, _, name = error.partition(":")
            raise getattr(importlib.import_module(module), name)(message)

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> None:
        """Sleep, then meet the other ranks in a barrier."""
        time.sleep(seconds)
        dist.barrier()

    @register(Dispatch.ONE_TO_ALL)
    def set_layout(self, dp_size: int) -> dict:
        """Pretend to be tensor parallel: dp replicas of world_size // dp_size ranks each."""
        tp = self.world_size // dp_size
        self.dp_rank, self.dp_size = self.rank // tp, dp_size
        self.is_output_rank = self.rank % tp == 0
        return {"dp_rank": self.dp_rank, "dp_size": self.dp_size}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data, offset: float = 0.0):
        """DataProto -> DataProto: y = x * 2 + 1 + offset, keeps ids, tags the rank in meta_info."""
        from ppoflow.infra.data.dataproto import DataProto

        out = DataProto.from_dict(
            tensors={"y": double_plus(data.batch["x"]) + offset, "id": data.batch["id"]},
            non_tensors={"name": data.non_tensor_batch["name"]},
            meta_info={"rank": self.rank, "rows": len(data)},
        )
        dist.barrier()
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def repeat3(self, data):
        """DataProto -> 3x the rows (interleaved), like n samples per prompt."""
        return data.repeat(3, interleave=True)

    @register(Dispatch.DP_COMPUTE_PROTO, metrics=(MetricRule(pattern="*_max", merge="max"),))
    def measure(self, data):
        """DataProto -> its ids, with ``metrics`` of this rank's rows: ``x_max`` (declared: the
        largest over the ranks) and ``x_mean`` (undeclared: the mean over the ranks)."""
        from ppoflow.infra.data.dataproto import DataProto

        x = data.batch["x"].double()
        metrics = {"x_max": x.max().item(), "x_mean": x.mean().item()}
        return DataProto.from_dict({"id": data.batch["id"]}, meta_info={"metrics": metrics})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def stats(self, data) -> dict:
        """DataProto -> dict: the rows this rank saw."""
        return {"rank": self.rank, "ids": data.batch["id"].tolist()}

    @register(Dispatch.ONE_TO_ALL)
    def say(self, text: str) -> None:
        """Print ``text`` on stdout and stderr (to test output streaming)."""
        print(f"{text} (stdout)", flush=True)
        print(f"{text} (stderr)", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        """Write a marker file (path from config["shutdown_marker"]) after a last collective."""
        dist.barrier()
        marker = self.config.get("shutdown_marker")
        if marker:
            with open(f"{marker}.{self.rank}", "w") as f:
                f.write("bye")

    def not_registered(self) -> None:
        """Exists but is not callable from the driver."""
