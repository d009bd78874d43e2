"""Device slots: a Prefect global concurrency limit so runs on one machine share its devices.

A run's worker groups are colocated on ``resources.nprocs`` devices of the machine and hold them
(models, optimizer state, KV cache) for the whole run, so the run occupies ``nprocs`` slots of the
limit ``ppoflow-<device>-<host>`` from before its groups start until they shut down. The limit is
created on first use with one slot per device (CUDA devices; CPU cores for ``device: cpu``) and is
taken with ``strict=True``: Prefect would silently ignore a missing limit without it. A CUDA run
that needs more slots than the limit has is refused (a CPU run takes all of them: CPU ranks may
share cores); one that finds them busy waits until they are free.

Change the size with ``prefect gcl update ppoflow-cuda-<host> --limit N`` (e.g. to reserve a GPU
for something else). A multi-node run (``resources.launch: rendezvous``) takes no slots: its ranks
run on nodes that Slurm or Kubernetes allocated to it.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ppoflow.infra.config import ConfigError, ExperimentConfig

__all__ = ["device_slots", "limit_name", "machine_devices"]


def limit_name(device: str) -> str:
    """The global concurrency limit of this machine's devices of kind ``device``."""
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "host"
    return f"ppoflow-{device}-{host}"


def machine_devices(device: str) -> int:
    """How many devices of kind ``device`` this machine has (CPU: cores)."""
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, os.cpu_count() or 1)


def _ensure_limit(name: str, size: int, log: Callable[[str], None]) -> int:
    """Create the limit if it is missing; return its size."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return int(client.read_global_concurrency_limit_by_name(name).limit)
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=size))
            log(f"created the global concurrency limit {name!r} with {size} slot(s)")
        except ObjectAlreadyExists:  # another run created it meanwhile
            pass
        return int(client.read_global_concurrency_limit_by_name(name).limit)


@contextmanager
def device_slots(cfg: ExperimentConfig, log: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    """Hold ``resources.nprocs`` slots of this machine's device limit inside the block."""
    from prefect.concurrency.sync import concurrency

    if cfg.resources.launch == "rendezvous":  # the ranks run on the agents' nodes, not here
        log("multi-node run: its devices are the nodes' (allocated by their scheduler); no slots taken here")
        yield {"limit": None, "slots": 0, "size": 0}
        return
    device, need = cfg.resources.device, cfg.resources.nprocs
    name = limit_name(device)
    size = _ensure_limit(name, machine_devices(device), log)
    if device == "cpu":
        need = min(need, size)  # CPU ranks may share cores: more ranks than cores take them all
    if need > size:
        raise ConfigError(
            f"resources.nprocs={need} needs {need} device slots but the global "
            f"concurrency limit {name!r} has {size}; lower resources.nprocs or raise "
            f"the limit (prefect gcl update {name} --limit {need})"
        )
    log(f"taking {need} of {size} slot(s) of {name!r}")
    with concurrency(name, occupy=need, strict=True):
        yield {"limit": name, "slots": need, "size": size}
