"""The base class of every worker that runs inside the ranks of a ``ppoflow.infra.remote.driver.group.WorkerGroup``.

    from ppoflow.infra.remote.rank.worker import Worker, register, Dispatch

    class MyWorker(Worker):
        def __init__(self, config: dict):
            super().__init__(config)          # sets rank, world_size, local_rank, device, dp_*
        @register(Dispatch.ONE_TO_ALL)
        def init_model(self) -> dict | None: ...
        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: DataProto, **kwargs) -> DataProto | dict | None: ...

Calling convention inside a rank (what ``ppoflow.infra.remote.rank.entry`` does for you):
- The worker is built once per group with the JSON config dict the driver passed to the group;
  torch.distributed is already initialised (gloo on CPU, nccl on CUDA).
- ONE_TO_ALL / RANK_ZERO methods get the JSON ``*args, **kwargs`` of the driver call and return
  something JSON-serialisable (dict, list, number, str, None).
- DP_COMPUTE_PROTO methods get ``(data: DataProto, **kwargs)``: ``data`` is the chunk for this
  rank's ``dp_rank``. They return a ``DataProto`` (saved by the rank, merged by the driver; only
  ranks with ``is_output_rank`` contribute), or a JSON dict / None (returned as a per-rank list).
  The output's ``meta_info["metrics"]`` are merged over the dp shards by the rules the method
  declares, ``@register(Dispatch.DP_COMPUTE_PROTO, metrics=(MetricRule(...), ...))``, else each is
  the mean over the shards (``ppoflow.infra.remote.metric_merge``).
- ``dp_rank``, ``dp_size`` and ``is_output_rank`` are re-read after every call and reported to the
  driver, so a worker whose data-parallel layout is not one rank per replica (e.g. vLLM tensor
  parallel) sets them in ``init_model`` and the next DP_COMPUTE_PROTO call uses the new layout.
- ``shutdown()`` is called once when the group shuts down, before the process group is destroyed:
  collectives still work there. Free big objects (engines, FSDP modules) in it.

Workers must not import Prefect (ranks stay light and independent of the orchestration layer).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ppoflow.infra.remote.dispatch import Dispatch, register
from ppoflow.infra.remote.metric_merge import MetricRule

__all__ = ["Worker", "register", "Dispatch", "MetricRule"]


class Worker:
    """Rank-local state of one worker; subclass it and tag driver-callable methods with ``register``.

    Attributes: ``config`` (the JSON dict), ``rank``, ``world_size``, ``local_rank``, ``device``
    (``cuda:<local_rank>`` on a CUDA group, else ``cpu``), ``dp_rank``/``dp_size`` (default: rank,
    world_size), ``is_output_rank`` (default True: this rank's DataProto outputs are kept).
    """

    def __init__(self, config: dict[str, Any] | None = None):
        self.config: dict[str, Any] = dict(config or {})
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank = torch.distributed.get_rank()
            self.world_size = torch.distributed.get_world_size()
        else:
            self.rank = int(os.environ.get("RANK", "0"))
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = _default_device(self.local_rank)
        self.dp_rank = self.rank
        self.dp_size = self.world_size
        self.is_output_rank = True

    def shutdown(self) -> None:
        """Hook called once on every rank when the group shuts down (collectives still work)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}/{self.world_size}, "
            f"dp={self.dp_rank}/{self.dp_size}, device={self.device})"
        )


def _default_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` if the group runs on CUDA (env PPOFLOW_DEVICE, else auto), else cpu."""
    want = os.environ.get("PPOFLOW_DEVICE", "")
    if want == "cuda" or (not want and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
