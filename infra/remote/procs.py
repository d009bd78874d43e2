"""Processes of a worker group, as the driver and the node agents see them: torchrun's command
line and environment, its output, and how to kill everything it started.

- ``torchrun_command`` / ``rendezvous_torchrun_command`` / ``rank_env``: how the ranks are launched
  and what they are told (:mod:`ppoflow.infra.remote.rank.entry` reads it).
- ``OutputPump``: a thread that streams the launcher's merged stdout/stderr line by line to a
  ``log`` callable and keeps the last lines for error messages.
- ``kill_process_group``: SIGKILL torchrun, every rank (each in a session of its own) and whatever
  the ranks spawned, and reap torchrun; ``block_until_exit``: how a rank watches its owner.
"""

from __future__ import annotations

import collections
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

import ppoflow

__all__ = [
    "RANK_MODULE",
    "LAUNCH_MODULE",
    "PRELOAD_ENV",
    "torchrun_command",
    "rendezvous_torchrun_command",
    "rank_env",
    "OutputPump",
    "pid_alive",
    "processes_with_env",
    "kill_process_group",
    "wait_pidfd",
    "block_until_exit",
]

#: The module every rank runs (its ``main``).
RANK_MODULE = "ppoflow.infra.remote.rank.entry"
#: The module that launches a group's ranks on a host: torchrun, the ranks forked from a process that
#: imported them once (CPU) or spawned (CUDA); see :mod:`ppoflow.infra.remote.rank.launch`.
LAUNCH_MODULE = "ppoflow.infra.remote.rank.launch"
#: The ranks' environment variable that names, comma-separated, modules their launcher imports
#: before it forks them (CPU groups; a rollout engine's ``preload``).
PRELOAD_ENV = "PPOFLOW_PRELOAD"
#: The folder that holds the ``ppoflow`` package the driver imported: the ranks import the same one.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(ppoflow.__file__)))


def torchrun_command(nprocs: int, log_dir: str) -> list[str]:
    """torchrun on this host (through ``LAUNCH_MODULE``, which appends the rank program), N ranks of
    ``ppoflow.infra.remote.rank.entry``, no restarts, output teed with a ``[rankN]:`` prefix (see
    ``rank_env``) and copied to per-rank files under ``log_dir``."""
    return [
        sys.executable,
        "-m",
        LAUNCH_MODULE,
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "--max-restarts=0",
        "--tee",
        "3",
        "--log-dir",
        log_dir,
    ]


def rendezvous_torchrun_command(
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    run_id: str,
    join_timeout_s: float,
    local_addr: str | None,
    log_dir: str,
) -> list[str]:
    """torchrun for one node of a group that spans ``nnodes`` nodes: c10d rendezvous at
    ``endpoint`` (a store the driver hosts: ``is_host=false``, no node hosts it) under the group's
    ``run_id``, no restarts, output teed and prefixed as in ``torchrun_command``."""
    conf = f"is_host=false,join_timeout={max(1, int(join_timeout_s))}"
    return [
        sys.executable,
        "-m",
        LAUNCH_MODULE,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--rdzv-conf={conf}",
        *([f"--local-addr={local_addr}"] if local_addr else []),
        "--max-restarts=0",
        "--tee",
        "3",
        "--log-dir",
        log_dir,
    ]


def rank_env(
    env: dict[str, str],
    address: tuple[str, int],
    authkey: bytes,
    worker: str,
    device: str,
    local_world: int,
) -> dict[str, str]:
    """The environment of torchrun and its ranks: ``env`` plus what ``ppoflow.infra.remote.rank.entry``
    reads (the driver's control address and authkey, the worker class, the device). The caller adds
    ``PPOFLOW_DRIVER_PID``: the local process whose death ends the ranks. ``local_world`` is the
    number of ranks on this host (it sets the default CPU threads per rank). CPU ranks' OpenMP
    threads sleep rather than spin while they wait (``OMP_WAIT_POLICY``, unless ``env`` sets it)."""
    env = dict(env)
    threads = env.get("PPOFLOW_RANK_THREADS", "")
    if not threads.isdigit():  # the rank reports a bad value; OMP just needs a number
        threads = str(max(1, (os.cpu_count() or 1) // local_world))
    env.setdefault("OMP_NUM_THREADS", threads)  # (and torchrun prints no banner)
    if device == "cpu":
        # A run's groups share the host's cores (the actor's and the critic's updates, the trainer
        # and the producer run at once): OpenMP threads that spin at each barrier while another
        # group holds the cores stall the step, where sleeping ones lose nothing. The demo at one
        # rank a group (two threads each, 2 cores): 8 iterations in 248 s with libgomp's own
        # policy, 46 s sleeping (benchmarks/cpu_wait_policy.py).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    env.update(
        {
            "PPOFLOW_DRIVER_ADDR": f"{address[0]}:{address[1]}",
            "PPOFLOW_AUTHKEY": authkey.hex(),
            "PPOFLOW_WORKER": worker,
            "PPOFLOW_DEVICE": device,
            "PYTHONUNBUFFERED": "1",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        }
    )
    return env


class OutputPump(threading.Thread):
    """Streams a binary pipe line by line to ``log`` and keeps the last ``keep`` lines."""

    def __init__(self, stream: IO[bytes], log: Callable[[str], None], keep: int = 200):
        super().__init__(name="ppoflow-rank-output", daemon=True)
        self._stream = stream
        self._log = log
        self._lines: collections.deque[str] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def run(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            with self._lock:
                self._lines.append(line)
            try:
                self._log(line)
            except Exception:  # noqa: BLE001 - a broken logger must not stop the pump
                pass
        self._stream.close()

    def tail(self, n: int = 200) -> str:
        """The last ``n`` lines seen, joined with newlines."""
        with self._lock:
            lines = list(self._lines)[-n:]
        return "\n".join(lines)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _proc_table() -> dict[int, tuple[int, int]]:
    """{pid: (ppid, pgid)} of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def processes_with_env(**pairs: str) -> list[int]:
    """Pids of this user's processes whose environment holds every ``NAME=value`` of ``pairs``
    (other users' environments are unreadable)."""
    needles = {f"{name}={value}".encode() for name, value in pairs.items()}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needles <= set(f.read().split(b"\0")):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _is_rank(pid: int) -> bool:
    """True if ``pid`` runs a rank (guards against a recycled pid): a spawned rank's command line
    names ``RANK_MODULE``, a forked one's is its launcher's (``LAUNCH_MODULE``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return RANK_MODULE.encode() in cmdline or LAUNCH_MODULE.encode() in cmdline


def _sigkill(kill: Callable[[int, int], None], target: int) -> None:
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_process_group(proc: subprocess.Popen, rank_pids: Sequence[int] = (), wait_s: float = 30.0) -> None:
    """SIGKILL torchrun, every process below it and every known rank, reap torchrun, and wait
    (up to ``wait_s`` in all) until the killed processes are gone.

    torchrun starts each spawned rank in a session of its own, so killing torchrun's process group
    is not enough: each descendant's process group is killed too (a rank's group holds whatever it
    spawned, e.g. engine subprocesses), and so are the ranks of ``rank_pids`` that are still
    running (they may have been reparented if torchrun already exited). Forked ranks stay in
    torchrun's group and go with it.

    The wait matters on GPUs: a killed rank gives its device memory back only when it has exited
    (a rank stuck in an NCCL collective after a peer died takes a moment to tear its CUDA context
    down), and the group that replaces it starts a vLLM engine that refuses to start unless its
    share of the device is free.
    """
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    running = proc.poll() is None  # once reaped, its pid (and group id) may be recycled
    victims, stack = set(), [proc.pid] if running else []
    while stack:
        for child in children.get(stack.pop(), []):
            victims.add(child)
            stack.append(child)
    victims |= {pid for pid in rank_pids if pid in table and _is_rank(pid)}
    for pid in victims:
        if table.get(pid, (0, 0))[1] == pid:  # a group leader: take its group with it
            _sigkill(os.killpg, pid)
        _sigkill(os.kill, pid)
    if running:
        _sigkill(os.killpg, proc.pid)
    deadline = time.monotonic() + wait_s
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        pass
    while any(pid_alive(pid) for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it exits), or None where pidfds are unavailable."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def block_until_exit(pid: int) -> None:
    """Return once process ``pid`` is gone (at once if it already is): a pidfd poll, or polling
    /proc where pidfds are unavailable. For watcher threads that end a process with its parent."""
    fd = wait_pidfd(pid)
    if fd is None:
        while pid_alive(pid):
            time.sleep(1.0)
        return
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll(1000):
        pass
    os.close(fd)
