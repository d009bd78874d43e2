"""The ephemeral Prefect API server of a CLI run, made to end with the process that started it.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server on first use (its
``SubprocessASGIServer``: uvicorn serving Prefect's app over the ``~/.prefect`` database, in a
subprocess) and stops it from an ``atexit`` hook. A ``ppoflow run`` killed with SIGKILL runs no
hook, so its server stayed behind (~200 MB and a little CPU each, holding the database).

:func:`own_ephemeral_server` registers, before Prefect needs one, a server of the same kind with
three differences in how its process is started:

- the process runs ``python -m ppoflow.flows.local_api PARENT_PID uvicorn-args...``: a thread
  watches the parent through a pidfd and ends the server the moment the parent is gone, however
  it went;
- it has a session of its own, so a Ctrl-C in the terminal reaches only the CLI, which still needs
  the server to record the run's final state, and stops it after that;
- its output goes to a log file instead of the terminal (``server.log_path``; removed when the
  server stops), so Prefect's server-side messages (telemetry, database retries) do not mix with
  the run's; a server that fails to start shows its last lines in the error. Usage telemetry is
  off, and the client side's INFO lines about it (its start, "Stopping temporary server on ...")
  stay out of the terminal too.

Prefect keeps doing the rest (port choice, health wait, the ``atexit`` stop). The CLI starts the
server in the background as soon as it knows it will run a flow, so its start-up overlaps the
CLI's own imports. With ``PREFECT_API_URL`` set, no temporary server is started and nothing
changes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ppoflow.infra.remote.procs import block_until_exit

__all__ = ["own_ephemeral_server"]


@functools.cache
def _server_class() -> type:
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class OwnedEphemeralServer(SubprocessASGIServer):
        """Prefect's temporary API server, in a process that dies with its parent (module docstring)."""

        log_path: str | None = None
        _start_lock = threading.Lock()

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            args = [
                *("--app-dir", str(prefect.__module_path__.parent)),
                *("--factory", "prefect.server.api.server:create_app"),
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--log-level", "error", "--lifespan", "on"),
            ]
            env = {
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
                **get_current_settings().to_environment_variables(exclude_unset=True),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            }
            if self.log_path is not None:  # a retry on another port (the first one was taken)
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)
            fd, self.log_path = tempfile.mkstemp(prefix="ppoflow-prefect-server-", suffix=".log")
            try:
                return subprocess.Popen(
                    [sys.executable, "-m", "ppoflow.flows.local_api", str(os.getpid()), self.log_path, *args],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=fd,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                os.close(fd)

        def start(self, timeout: int | None = None) -> None:
            # Prefect marks the server running before it answers; a caller arriving meanwhile (the
            # flow, while :func:`own_ephemeral_server` starts it early) waits here until it does.
            with self._start_lock:
                self._start(timeout)

        def _start(self, timeout: int | None) -> None:
            try:
                with _quiet_server_logger():
                    super().start(timeout)
            except Exception as exc:
                tail = ""
                if self.log_path is not None:
                    with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
                        tail = "".join(f.readlines()[-20:])
                raise RuntimeError(
                    f"the temporary Prefect API server did not start: {exc}"
                    + (f"\n--- its last output ({self.log_path}) ---\n{tail}" if tail else "")
                    + "\n(a slow machine may need PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS raised; "
                    "or run `prefect server start` and set PREFECT_API_URL)"
                ) from exc

        def stop(self) -> None:
            with _quiet_server_logger():
                super().stop()
            if self.log_path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)

    return OwnedEphemeralServer


@contextlib.contextmanager
def _quiet_server_logger() -> Iterator[None]:
    """Prefect's INFO lines about the temporary server ("Stopping temporary server on ...", how
    to run a dedicated one) stay out of the terminal: the user never started a server."""
    from prefect.server.api.server import subprocess_server_logger as logger

    level = logger.level
    logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        logger.setLevel(level)


def own_ephemeral_server(start_now: bool = True) -> Any:
    """Make the temporary API server this process may need one that ends with it (module
    docstring), and with ``start_now``, when Prefect will need one (no ``PREFECT_API_URL``),
    start it in the background at once: its start-up (seconds) overlaps the imports and checks
    before the first flow run, which waits for it. Call before the first flow run; later calls
    return the same server."""
    from prefect.settings import PREFECT_API_URL

    server = _server_class()()  # registered as Prefect's default temporary server (its per-port table)
    if start_now and not PREFECT_API_URL.value() and hasattr(server, "_start_lock"):
        threading.Thread(
            target=_start_quietly, args=(server,), name="ppoflow-prefect-server", daemon=True
        ).start()
    return server


def _start_quietly(server: Any) -> None:
    """Start ``server``; a failure is left to the flow's own start, which raises it."""
    with contextlib.suppress(Exception):
        server.start()


def _exit_with_parent(parent: int, log_path: str) -> None:
    """Thread body in the server process: exit as soon as process ``parent`` is gone."""
    block_until_exit(parent)
    with contextlib.suppress(OSError):
        os.unlink(log_path)
    os._exit(0)


def main(argv: list[str]) -> None:
    """``python -m ppoflow.flows.local_api PARENT_PID LOG_PATH UVICORN_ARGS...``: serve Prefect's
    API with uvicorn until told to stop, or until the parent process is gone."""
    parent, log_path, uvicorn_args = int(argv[0]), argv[1], argv[2:]
    threading.Thread(
        target=_exit_with_parent, args=(parent, log_path), name="ppoflow-parent-watch", daemon=True
    ).start()
    from uvicorn.main import main as uvicorn_main

    uvicorn_main(uvicorn_args, prog_name="uvicorn")


if __name__ == "__main__":
    main(sys.argv[1:])
