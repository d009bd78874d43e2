"""Device slots: how runs on one machine share its devices, one OS file lock per device.

A run's worker groups hold ``resources.nprocs`` devices (models, optimizer state, KV cache) for
the whole run, so the run takes ``nprocs`` slots before its groups start and gives them back
after they shut down. Slot ``i`` of device kind ``d`` is the file ``<slots dir>/<d>-<i>.lock``,
held by ``flock(LOCK_EX)`` on an open descriptor. The kernel drops the lock the moment the
holding process ends, however it ends (SIGKILL and OOM kills included): a run that died never
keeps the machine's devices, and the next run takes them at once.

Why not a Prefect global concurrency limit (ppoflow's first design)? In Prefect 3.9 the slots of a
limit are a count in the database, and the lease that gives them back when its holder stops
renewing is revoked by the server's ``repossessor`` service, which does not run in the ephemeral
API server a ``ppoflow run`` starts (``run_in_ephemeral=False``); the lease itself lives in that
server's memory (the default lease storage). After a ``kill -9`` of a run the count stayed taken
for good, and every later run on the machine waited forever. On a long-lived server a dead
holder's slots came back only after the lease ran out (at least 60 s, 300 s by default) plus
the repossessor's loop.

- Slots: one per CUDA device, or per core for ``device: cpu``; ``PPOFLOW_DEVICE_SLOTS`` overrides
  the count (e.g. to keep a GPU for something else).
- A run takes all its slots at once or none (two half-served runs never wait on each other). A
  CUDA run that needs more slots than the machine has is refused; a CPU run takes them all (CPU
  ranks may share cores).
- A run that finds them taken waits, polling every second, and says who holds them (each
  holder writes its run, experiment and pid into its lock files).
- Slots dir: ``PPOFLOW_SLOTS_DIR``, default ``<temp dir>/ppoflow-slots``, shared by every user of
  the machine (the files are world-writable). Keep it on a local disk: ``flock`` over NFS is not
  dependable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from ppoflow.infra.config import ConfigError, ExperimentConfig

__all__ = ["device_slots", "machine_devices", "slots_dir", "slot_holders", "SLOTS_ENV", "DIR_ENV"]

SLOTS_ENV = "PPOFLOW_DEVICE_SLOTS"
DIR_ENV = "PPOFLOW_SLOTS_DIR"


def slots_dir() -> str:
    """The directory of the machine's slot lock files."""
    return os.environ.get(DIR_ENV) or os.path.join(tempfile.gettempdir(), "ppoflow-slots")


def machine_devices(device: str) -> int:
    """How many slots devices of kind ``device`` have here: ``PPOFLOW_DEVICE_SLOTS``, else the
    CUDA device count (``cuda``) or the cores (``cpu``)."""
    override = os.environ.get(SLOTS_ENV, "").strip()
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ConfigError(f"{SLOTS_ENV}={override!r}: expected a whole number >= 1")
        return int(override)
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, os.cpu_count() or 1)


def _path(device: str, index: int) -> str:
    return os.path.join(slots_dir(), f"{device}-{index}.lock")


def _open(path: str) -> int:
    """Open (creating) a slot file that any user of the machine can lock."""
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o1777)  # shared like /tmp: everyone may add, owners may remove
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)
    return fd


def _try_lock(path: str) -> int | None:
    """The descriptor holding slot ``path``, or None if another process holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the file was removed or replaced meanwhile: our lock guards nothing
        os.close(fd)
        return _try_lock(path)
    return fd


def _holder(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def slot_holders(device: str, size: int) -> list[dict[str, Any]]:
    """Who holds the taken slots of ``device`` (a dict per taken slot, as its holder wrote it)."""
    held = []
    for i in range(size):
        fd = _try_lock(_path(device, i))
        if fd is None:
            held.append({"slot": i, **_holder(_path(device, i))})
        else:
            os.close(fd)
    return held


def _describe(holders: list[dict[str, Any]]) -> str:
    runs: dict[Any, dict[str, Any]] = {}
    for h in holders:
        runs.setdefault((h.get("run"), h.get("pid")), h)
    return "; ".join(
        f"run {h.get('run', '?')} of {h.get('experiment', '?')} (pid {h.get('pid', '?')} on "
        f"{h.get('host', '?')}, since {time.strftime('%H:%M:%S', time.localtime(h.get('since', 0)))})"
        for h in runs.values()
    )


def _take(device: str, size: int, need: int, who: bytes) -> dict[int, int] | None:
    """Lock ``need`` free slots (all or none): {slot: fd}, or None if fewer are free."""
    held: dict[int, int] = {}
    for i in range(size):
        if len(held) == need:
            break
        fd = _try_lock(_path(device, i))
        if fd is not None:
            held[i] = fd
    if len(held) < need:
        for fd in held.values():
            os.close(fd)
        return None
    for fd in held.values():
        os.ftruncate(fd, 0)
        os.pwrite(fd, who, 0)
    return held


@contextlib.contextmanager
def device_slots(
    cfg: ExperimentConfig,
    log: Callable[[str], None],
    *,
    run_id: str = "",
    wait_log: Callable[[str], None] | None = None,
    poll_s: float = 1.0,
    notice_s: float = 60.0,
) -> Iterator[dict[str, Any]]:
    """Hold ``resources.nprocs`` of this machine's device slots inside the block (none for a
    multi-node run: its nodes' scheduler allocated their devices).

    Yields ``{"slots": [indices], "size": N, "dir": ...}``. Waits while they are taken, telling
    ``wait_log`` (default ``log``) who holds them at once and every ``notice_s`` seconds.
    """
    if cfg.resources.launch == "rendezvous":  # the ranks run on the agents' nodes, not here
        log("multi-node run: its devices are the nodes' (allocated by their scheduler); no slots taken here")
        yield {"slots": [], "size": 0, "dir": None}
        return
    device, need = cfg.resources.device, cfg.resources.nprocs
    size = machine_devices(device)
    if device == "cpu":
        need = min(need, size)  # CPU ranks may share cores: more ranks than cores take them all
    if need > size:
        raise ConfigError(
            f"resources.nprocs={need} needs {need} {device} device slots but this machine has {size}; "
            f"lower resources.nprocs (or set {SLOTS_ENV} if the machine has more devices than detected)"
        )
    who = json.dumps(
        {
            "run": run_id,
            "experiment": cfg.storage.experiment_url,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
        }
    ).encode()
    wait_log = wait_log or log
    held = _take(device, size, need, who)
    last_notice = None
    while held is None:
        now = time.monotonic()
        if last_notice is None or now - last_notice >= notice_s:
            wait_log(
                f"waiting for {need} of this machine's {size} {device} device slot(s), held by "
                f"{_describe(slot_holders(device, size)) or 'a run that is just ending'}; this run "
                "starts when they are free (each slot frees itself when its holder's process ends)"
            )
            last_notice = now
        time.sleep(poll_s)
        held = _take(device, size, need, who)
    log(f"holding {device} device slot(s) {sorted(held)} of {size} ({slots_dir()})")
    try:
        yield {"slots": sorted(held), "size": size, "dir": slots_dir()}
    finally:
        for fd in held.values():
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
