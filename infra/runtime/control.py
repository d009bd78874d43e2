"""Driver-side plumbing of ``ppoflow.infra.runtime.launch.WorkerGroup``: the control listener, the output pump,
JSON messages and killing a launched process group.

- ``torchrun_command`` / ``rank_env``: how the ranks are launched and what they are told.
- ``ControlListener``: a TCP listener on 127.0.0.1 with a random authkey whose ``accept`` takes a
  timeout (``multiprocessing.connection.Listener.accept`` cannot), speaking the same HMAC handshake
  as ``multiprocessing.connection.Client`` on the rank side.
- ``send_json`` / ``recv_json``: every message is JSON bytes over ``send_bytes``/``recv_bytes``;
  nothing is ever pickled or unpickled.
- ``OutputPump``: a thread that streams the launcher's merged stdout/stderr line by line to a
  ``log`` callable and keeps the last lines for error messages.
- ``kill_process_group``: SIGKILL torchrun, every rank (each in a session of its own) and whatever
  the ranks spawned, and reap torchrun.
- ``GroupResources``: everything a group holds, released by one idempotent ``release()``.
"""

from __future__ import annotations

import collections
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from typing import IO, Any


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the group was killed. The message holds the rank number,
    the method and the traceback (or the launcher's output tail)."""

    def __init__(self, message: str, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.method = method


class WorkerGroupDead(RuntimeError):
    """A call on a group that failed before or was shut down: start a new WorkerGroup."""


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_command(nprocs: int, log_dir: str) -> list[str]:
    """torchrun on this host, N ranks of ``ppoflow.infra.runtime.rank_entry``, no restarts, output teed with a
    ``[rankN]:`` prefix (see ``rank_env``) and copied to per-rank files under ``log_dir``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "--max-restarts=0",
        "--tee",
        "3",
        "--log-dir",
        log_dir,
        "-m",
        "ppoflow.infra.runtime.rank_entry",
    ]


def rank_env(
    env: dict[str, str], listener: ControlListener, worker: str, device: str, nprocs: int
) -> dict[str, str]:
    """The environment of torchrun and the ranks: ``env`` plus what ``ppoflow.infra.runtime.rank_entry`` reads."""
    env = dict(env)
    threads = env.get("PPOFLOW_RANK_THREADS", "")
    if not threads.isdigit():  # the rank reports a bad value; OMP just needs a number
        threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    env.setdefault("OMP_NUM_THREADS", threads)  # (and torchrun prints no banner)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    env.update(
        {
            "PPOFLOW_DRIVER_ADDR": f"{listener.address[0]}:{listener.address[1]}",
            "PPOFLOW_AUTHKEY": listener.authkey.hex(),
            "PPOFLOW_DRIVER_PID": str(os.getpid()),
            "PPOFLOW_WORKER": worker,
            "PPOFLOW_DEVICE": device,
            "PYTHONUNBUFFERED": "1",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]:",
        }
    )
    return env


def send_json(conn: Connection, msg: Any) -> None:
    """Send one JSON message (UTF-8 bytes)."""
    conn.send_bytes(json.dumps(msg).encode())


def recv_json(conn: Connection) -> Any:
    """Receive one JSON message; ``EOFError``/``OSError`` when the peer is gone."""
    return json.loads(conn.recv_bytes())


class ControlListener:
    """Accepts authenticated ``multiprocessing.connection`` links from the ranks, with timeouts."""

    def __init__(self, host: str = "127.0.0.1"):
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]

    def accept(self, timeout: float) -> Connection | None:
        """One authenticated connection, or None if none arrived within ``timeout`` seconds (or the
        peer failed the handshake)."""
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not readable:
            return None
        sock, _ = self._sock.accept()
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except (AuthenticationError, EOFError, OSError):
            conn.close()
            return None
        return conn

    def close(self) -> None:
        self._sock.close()


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


def _is_rank(pid: int) -> bool:
    """True if ``pid`` runs ``ppoflow.infra.runtime.rank_entry`` (guards against a recycled pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ppoflow.infra.runtime.rank_entry" in f.read()
    except OSError:
        return False


def _sigkill(kill: Callable[[int, int], None], target: int) -> None:
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_process_group(proc: subprocess.Popen, rank_pids: list[int] = (), wait_s: float = 30.0) -> None:
    """SIGKILL torchrun, every process below it and every known rank, reap torchrun, and wait
    (up to ``wait_s`` in all) until the killed processes are gone.

    torchrun starts each rank in a session of its own, so killing torchrun's process group is
    not enough: each descendant's process group is killed too (a rank's group holds whatever it
    spawned, e.g. engine subprocesses), and so are the ranks of ``rank_pids`` that are still
    running ``ppoflow.infra.runtime.rank_entry`` (they may have been reparented if torchrun already exited).

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


class GroupResources:
    """What must be released when a group ends, shut down or not (held by a weakref finalizer)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pump: OutputPump | None = None
        self.listener: ControlListener | None = None
        self.conns: list[Connection] = []
        self.pidfd: int | None = None
        self.scratch: str | None = None
        self.rank_pids: list[int] = []
        self.killed = False

    def release(self) -> None:
        """Kill the process group (if still running), close every handle, remove the scratch dir."""
        if self.proc is not None and not self.killed:
            self.killed = True
            kill_process_group(self.proc, self.rank_pids)
        if self.pump is not None:
            self.pump.join(timeout=2.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
