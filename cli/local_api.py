"""The Prefect API server of a CLI run when no ``PREFECT_API_URL`` is set: Prefect's own
``prefect server start``, in a process that ends with the CLI however the CLI ends.

Prefect's answer to a missing ``PREFECT_API_URL`` is a temporary server that it stops from an
``atexit`` hook; a ``ppoflow run`` killed with SIGKILL runs no hook, and such a server stayed
behind (holding the database). So the CLI starts one itself, through Prefect's public command
and settings only:

- ``python -m ppoflow.cli.local_api PARENT_PID LOG_PATH --port P`` runs Prefect's console
  script, ``prefect server start --host 127.0.0.1 --port P --no-ui --no-scheduler
  --no-late-runs --analytics-off`` (the scheduler stays off: a run's server must not schedule
  the deployments it finds in the database), in a session of its own, with a thread that
  watches the parent through a pidfd and kills the session the moment the parent is gone;
- a Ctrl-C in the terminal reaches only the CLI (the server is in another session), which still
  needs the server to record the run's final state, and stops it after that;
- its output goes to a log file, not the terminal (removed when the server stops); a server that
  fails to start shows the file's last lines in the error;
- ``PREFECT_API_URL`` points at it for the whole process from the moment its port is chosen
  (before any flow starts, so Prefect's client and its background log and event workers all use
  it: ``prefect.context.refresh_global_settings_context`` makes the variable seen), and is put
  back when the server stops; the runs are in the default database, so a ``prefect server
  start`` on the same machine shows them in its UI afterwards.

The CLI starts the server in the background as soon as it knows it will run a flow, so its
start-up overlaps the CLI's own imports and checks. With ``PREFECT_API_URL`` set, no server is
started and nothing changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from ppoflow.infra.remote.procs import block_until_exit

__all__ = ["LocalServer", "local_server"]

#: How long the server may take to answer (a first start on a new database migrates it).
START_TIMEOUT_S = float(os.environ.get("PPOFLOW_PREFECT_SERVER_TIMEOUT_S", "180"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """One ``prefect server start`` for this process (module docstring): :meth:`start_in_background`
    as early as possible, :meth:`wait` before the first flow runs, :meth:`stop` at the end."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.log_path: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._previous_url = os.environ.get("PREFECT_API_URL")

    def start_in_background(self) -> None:
        """Point ``PREFECT_API_URL`` at the server and start it in a thread (idempotent)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            port = self._use(_free_port())
        threading.Thread(
            target=self._start_or_record, args=(port,), name="ppoflow-prefect-server", daemon=True
        ).start()

    def _use(self, port: int) -> int:
        """Make ``port``'s server the Prefect API of this whole process."""
        from prefect.context import refresh_global_settings_context

        self.url = f"http://127.0.0.1:{port}/api"
        os.environ["PREFECT_API_URL"] = self.url
        refresh_global_settings_context()
        return port

    def _start_or_record(self, port: int) -> None:
        try:
            self._start(port)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() in the caller's thread
            self._error = exc
        finally:
            self._done.set()

    def _start(self, port: int) -> None:
        _make_prefect_home()
        for attempt in range(3):  # a port taken between choosing it and binding it: another one
            if attempt:
                port = self._use(_free_port())
            fd, self.log_path = tempfile.mkstemp(prefix="ppoflow-prefect-server-", suffix=".log")
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "ppoflow.cli.local_api", str(os.getpid()), self.log_path]
                    + ["--port", str(port)],
                    env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
                    stdin=subprocess.DEVNULL,
                    stdout=fd,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                os.close(fd)
            if self._wait_healthy(f"http://127.0.0.1:{port}/api"):
                return
            tail = self._tail()
            status = self._proc.poll() if self._proc is not None else None
            self._end_process()
            if "already in use" not in tail:
                if status is None:
                    what = f"did not answer within {START_TIMEOUT_S:.0f} s"
                    fix = "a slow first start may need PPOFLOW_PREFECT_SERVER_TIMEOUT_S raised"
                else:
                    what = f"exited with status {status} before it answered"
                    fix = "its last output above says why"
                raise RuntimeError(
                    f"the local Prefect API server {what}"
                    + (f"\n--- its last output ---\n{tail}" if tail else "")
                    + f"\n({fix}; or run `prefect server start` and set PREFECT_API_URL)"
                )
        raise RuntimeError("the local Prefect API server found no free port on 127.0.0.1 (three tries)")

    def _wait_healthy(self, url: str) -> bool:
        """True once ``url/health`` answers; False if the process ends or time runs out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.2)
        return False

    def _tail(self, lines: int = 20) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
        return ""

    def wait(self) -> str:
        """The server's API URL once it answers (it is started if it was not); its start error."""
        self.start_in_background()
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self.url is not None
        return self.url

    def _end_process(self) -> None:
        """SIGTERM to the server's session, SIGKILL after 10 s; its log removed."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    def stop(self) -> None:
        """Send what Prefect's log and event workers still hold, end the server, and give
        ``PREFECT_API_URL`` back its value from before (idempotent)."""
        if self._proc is not None:
            _drain_prefect_workers()
        self._end_process()
        with self._lock:
            if not self._started:
                return
            self._started = False
        from prefect.context import refresh_global_settings_context

        if self._previous_url is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = self._previous_url
        refresh_global_settings_context()
        self._done.clear()
        self._error = None


def _drain_prefect_workers() -> None:
    """Prefect sends logs and events from background workers: let them deliver what they hold
    (at most a few seconds each) while the server still answers."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler

    for drain in (APILogHandler().flush, lambda: EventsWorker.drain_all(timeout=5)):
        with contextlib.suppress(Exception):  # best effort: the run's outcome is already decided
            drain()


def _make_prefect_home() -> None:
    """Create Prefect's home (``PREFECT_HOME``, where the server keeps its database) with its
    parents: Prefect makes only the last level, and a server without it fails on its database."""
    from prefect.settings import get_current_settings

    home = get_current_settings().home
    try:
        os.makedirs(home, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(
            f"Prefect's home directory {str(home)!r} (PREFECT_HOME) cannot be created: {exc}. "
            "Set PREFECT_HOME to a writable directory, or run `prefect server start` and set "
            "PREFECT_API_URL"
        ) from None


_SERVER: LocalServer | None = None


def local_server() -> LocalServer | None:
    """This process's local server, or None when ``PREFECT_API_URL`` (from the environment or the
    active Prefect profile) names a server to use instead."""
    global _SERVER
    from prefect.settings import PREFECT_API_URL

    if _SERVER is not None:
        return _SERVER
    if PREFECT_API_URL.value():
        return None
    _SERVER = LocalServer()
    return _SERVER


def _exit_with_parent(parent: int, log_path: str) -> None:
    """Thread body in the server process: end the whole session once process ``parent`` is gone."""
    block_until_exit(parent)
    with contextlib.suppress(OSError):
        os.unlink(log_path)
    os.killpg(os.getpgid(0), signal.SIGKILL)


def main(argv: list[str]) -> None:
    """``python -m ppoflow.cli.local_api PARENT_PID LOG_PATH --port P``: Prefect's ``prefect
    server start`` until told to stop, or until the parent process is gone."""
    from importlib.metadata import entry_points

    parent, log_path, rest = int(argv[0]), argv[1], argv[2:]
    threading.Thread(
        target=_exit_with_parent, args=(parent, log_path), name="ppoflow-parent-watch", daemon=True
    ).start()
    (prefect_cli,) = entry_points(group="console_scripts", name="prefect")
    sys.argv = ["prefect", "server", "start", "--host", "127.0.0.1", *rest]
    sys.argv += ["--no-ui", "--no-scheduler", "--no-late-runs", "--analytics-off", "--log-level", "ERROR"]
    sys.exit(prefect_cli.load()())


if __name__ == "__main__":
    main(sys.argv[1:])
