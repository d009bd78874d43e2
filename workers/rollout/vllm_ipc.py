"""Named IPC resources of vLLM's CPU tensor parallelism, released as soon as the engine has started.

With TP > 1 on the CPU backend, vLLM's groups set up, per engine start:
- one POSIX shm segment per rank for the shm all-reduce (``/dev/shm/-tp:0-[0-1]-cpushm_<rank>``).
  Under ``external_launcher`` the name has no per-run part, and the segment is created with
  O_EXCL: a group that ends with ``os._exit`` (as ppoflow's ranks do) or is killed leaves it behind,
  and the next TP engine on the host fails with "create shm in SHMManager failed. errno: 17";
- a 24 MiB ``multiprocessing.shared_memory`` ring buffer (``/dev/shm/psm_*``) and two ZeroMQ IPC
  sockets (``/tmp/<uuid>``) for the TP group's message-queue broadcaster, unlinked only by
  ``__del__``: every run that exits with ``os._exit`` leaks them.

Every rank maps the segments and connects the sockets while the engine starts, and nothing opens
them by name afterwards, so the names can be unlinked right after start-up (the mappings and
connections stay valid): :func:`release_names`. :func:`remove_stale_segments` clears shm-allreduce
names older than two minutes (left by a group that died while starting) before a new start.
"""

from __future__ import annotations

import logging
import os
import time

import torch.distributed as dist

__all__ = ["remove_stale_segments", "release_names"]

_LOG = logging.getLogger("ppoflow.rollout")
_SHM_DIR = "/dev/shm"
_STALE_S = 120.0


def remove_stale_segments(max_age_s: float = _STALE_S) -> list[str]:
    """Unlink CPU-TP shm-allreduce segments whose names are older than ``max_age_s``."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(_SHM_DIR) if "-cpushm_" in n]
    except OSError:
        return removed
    now = time.time()
    for name in names:
        path = os.path.join(_SHM_DIR, name)
        try:
            if now - os.stat(path).st_mtime > max_age_s:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    if removed:
        _LOG.warning("removed stale vLLM shm segments %s", removed)
    return removed


def _unlink_shared_memory(owner) -> None:
    """Unlink a creator-side ``SharedMemory`` held by ``owner.shared_memory`` (keep the mapping)."""
    shm = getattr(owner, "shared_memory", None)
    if shm is not None and getattr(owner, "is_creator", False):
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        owner.is_creator = False  # its __del__ must not unlink again


def _unlink_ipc(addr: str | None) -> None:
    if addr and addr.startswith("ipc://"):
        try:
            os.unlink(addr[len("ipc://") :])
        except OSError:
            pass


def release_names() -> int:
    """After the engine started on every rank: unlink this rank's named shm segments and IPC
    sockets of vLLM's process groups. Collective over each group that has some (a barrier each).
    Returns the number of groups handled."""
    from vllm.distributed import parallel_state as ps

    seen, handled = set(), 0
    for value in list(vars(ps).values()):
        comm = getattr(getattr(value, "device_communicator", None), "dist_module", None)
        name = getattr(comm, "group_name", None)
        mq = getattr(value, "mq_broadcaster", None)
        if id(value) in seen or (name is None and mq is None):
            continue
        seen.add(id(value))
        dist.barrier(group=value.cpu_group)  # every rank of the group has mapped / connected
        if name is not None:
            try:
                os.unlink(os.path.join(_SHM_DIR, f"{name.lstrip('/')}_{value.rank_in_group}"))
            except FileNotFoundError:
                pass
        if mq is not None and getattr(mq, "_is_writer", False):
            _unlink_shared_memory(getattr(mq, "buffer", None))
            _unlink_shared_memory(getattr(mq, "tensor_arena", None))
            handle = getattr(mq, "handle", None)
            _unlink_ipc(getattr(handle, "local_subscribe_addr", None))
            _unlink_ipc(getattr(handle, "local_notify_addr", None))
        handled += 1
    return handled
