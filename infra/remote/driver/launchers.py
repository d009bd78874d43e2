"""How a ``WorkerGroup``'s ranks are started, watched and killed: the ``Launcher`` seam.

A ``WorkerGroup`` speaks to its ranks over one authenticated JSON link per rank and does not care
where they run. A launcher owns the rest:

- ``start(worker, device, env, log)`` starts the ranks (they connect back and say hello);
- ``poll_hello(timeout)`` hands over the next (link, hello) of a rank that connected;
- ``failure()`` is None while the launched processes are healthy, else one line saying what
  ended (``torchrun exited (status 1)``, ``node 1 (host b) was lost ...``); ``event_fd`` is a
  file descriptor that becomes readable when that happens, for ``multiprocessing.connection.wait``;
- ``wait(timeout)`` after a clean shutdown: True once every launched process exited;
- ``release()`` kills whatever is left, closes every handle and removes the scratch space.

Two launchers: :class:`LocalLauncher` here (``torchrun --standalone`` as a child of this process,
all ranks on this host) and ``ppoflow.infra.remote.driver.rendezvous.RendezvousLauncher`` (ranks on several
hosts, started by per-node agents through a c10d rendezvous).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection

from ppoflow.infra.remote.links import ControlListener
from ppoflow.infra.remote.procs import OutputPump, kill_process_group, rank_env, torchrun_command, wait_pidfd
from ppoflow.infra.remote.protocol import Hello, ProtocolError, receive

__all__ = ["Launcher", "LocalLauncher"]


class Launcher:
    """The interface a ``WorkerGroup`` drives (see the module docstring). Subclasses set
    ``nprocs`` and ``scratch`` (a local directory or a storage URL every rank can read)."""

    nprocs: int
    scratch: str | None = None
    rank_pids: list[int]
    #: True when ranks run on several nodes: failure messages then lead with the node's fate
    names_nodes: bool = False

    def start(self, worker: str, device: str, env: dict[str, str], log: Callable[[str], None]) -> None:
        """Start the ranks of ``worker`` on ``device``; ``env``: the group's extra environment
        variables for its ranks (on top of the environment of the process that runs them)."""
        raise NotImplementedError

    def poll_hello(self, timeout: float) -> tuple[Connection, Hello] | None:
        """The next rank link and its hello, or None within ``timeout``; ``EOFError`` if a rank
        closed its link before saying hello."""
        raise NotImplementedError

    @property
    def event_fd(self) -> int | None:
        return None

    def failure(self) -> str | None:
        raise NotImplementedError

    def wait(self, timeout: float) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def output_tail(self, n: int = 200) -> str:
        return ""

    def describe(self) -> str:
        """One line for logs: where the ranks run."""
        return f"{self.nprocs} ranks"

    def placement(self, hellos: dict[int, Hello]) -> str | None:
        """After start: which ranks run where (None: nothing worth saying)."""
        return None

    def missing(self, hellos: dict[int, Hello]) -> str:
        """During start: where the ranks that have not connected yet should come from ("" if
        that says nothing more than the count)."""
        return ""


class LocalLauncher(Launcher):
    """``python -m torch.distributed.run --standalone --nproc-per-node=N ... -m
    ppoflow.infra.remote.rank.entry`` in a session of its own (so the whole group can be killed
    as one), ranks connecting to a listener on 127.0.0.1 with a random authkey, DataProto chunks
    in a temp directory under ``scratch_dir`` (default: the system temp dir)."""

    def __init__(self, nprocs: int, scratch_dir: str | None = None):
        self.nprocs = int(nprocs)
        self.scratch_parent = scratch_dir
        self.rank_pids = []
        self.proc: subprocess.Popen | None = None
        self.pump: OutputPump | None = None
        self.listener: ControlListener | None = None
        self.pidfd: int | None = None
        self._pending: list[Connection] = []
        self._killed = False

    @property
    def pid(self) -> int | None:
        """torchrun's pid."""
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def start(self, worker: str, device: str, env: dict[str, str], log: Callable[[str], None]) -> None:
        self.scratch = tempfile.mkdtemp(prefix="ppoflow-group-", dir=self.scratch_parent)
        self.listener = ControlListener()
        env = rank_env(
            {**os.environ, **env}, self.listener.address, self.listener.authkey, worker, device, self.nprocs
        )
        env["PPOFLOW_DRIVER_PID"] = str(os.getpid())  # the ranks exit when this process dies
        self.proc = subprocess.Popen(
            torchrun_command(self.nprocs, os.path.join(self.scratch, "logs")),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pidfd = wait_pidfd(self.proc.pid)
        assert self.proc.stdout is not None  # stdout=PIPE
        self.pump = OutputPump(self.proc.stdout, log)
        self.pump.start()

    def poll_hello(self, timeout: float) -> tuple[Connection, Hello] | None:
        assert self.listener is not None, "start() first"
        conn = self.listener.accept(timeout)
        if conn is not None:
            self._pending.append(conn)
        for c in [c for c in self._pending if c.poll(0)]:
            self._pending.remove(c)
            try:
                hello = receive(c, Hello)
            except (EOFError, OSError, ProtocolError) as err:
                c.close()
                raise EOFError(f"a rank closed its link before saying hello ({err})") from None
            self.rank_pids.append(hello.pid)
            return c, hello
        return None

    @property
    def event_fd(self) -> int | None:
        return self.pidfd

    def failure(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        if self.pump is not None:  # torchrun's last lines (its failure report) are in the tail
            self.pump.join(timeout=1.0)
        return f"torchrun exited (status {self.proc.returncode})"

    def wait(self, timeout: float) -> bool:
        assert self.proc is not None, "start() first"
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def output_tail(self, n: int = 200) -> str:
        return self.pump.tail(n) if self.pump is not None else ""

    def describe(self) -> str:
        return f"{self.nprocs} ranks on this host"

    def release(self) -> None:
        """Kill the process group (if still running), close every handle, remove the scratch dir."""
        if self.proc is not None and not self._killed:
            self._killed = True
            kill_process_group(self.proc, self.rank_pids)
        if self.pump is not None:
            self.pump.join(timeout=2.0)
        for conn in self._pending:
            conn.close()
        self._pending = []
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
