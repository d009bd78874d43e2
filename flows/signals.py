"""SIGTERM that ends a run the way Ctrl-C does: cleanly, fast, and never half-way through an import.

Python's default SIGTERM action kills the process without running ``finally`` blocks or atexit
hooks; Prefect's handler (installed while a flow runs) raises its ``TerminationSignal`` and then
re-sends the signal to the handler that was there before. With :func:`install_sigterm_handler`
that handler raises :class:`Terminated`, a ``SystemExit``: the flow kills its worker groups,
releases the experiment lock and the device slots, the temporary Prefect server is stopped, and
the process exits with status 143.

An exception raised by a signal handler lands wherever the main thread is, and a process start
is mostly imports. Raised inside one it was seen to go wrong twice (measured with the CLI, SIGTERM
at 0.1-7 s after start, on a loaded 2-core machine): inside ``import torch.distributed`` (torch's
C++ calls back into Python) it became a C++ exception and the process aborted (``terminate called
after throwing an instance of 'pybind11::error_already_set'``, exit -6); inside a library's import
that catches everything, the signal was swallowed and the run went on to commit. So:

- :func:`exit_on_sigterm`, for the start of a command, before it holds anything: SIGTERM prints
  one line and ends the process at once (``os._exit``, status 143). Nothing needs releasing yet;
  the temporary Prefect server's process ends with its parent (``ppoflow.flows.local_api``).
- :func:`install_sigterm_handler`, for the rest: a SIGTERM that arrives in the middle of an import
  is re-sent to this process 0.1 s later until it lands outside one, then raises.

This module imports nothing heavy, so the CLI installs its handler before it imports torch,
Prefect or vLLM.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["Terminated", "exit_on_sigterm", "install_sigterm_handler"]

RESEND_S = 0.1  # how long a SIGTERM that arrived mid-import waits before it is tried again


class Terminated(SystemExit):
    """SIGTERM, as raised by the handler of :func:`install_sigterm_handler` (exit status 143)."""


def _importing(frame: FrameType | None) -> bool:
    """True when ``frame`` or one of its callers is the import machinery (a module being loaded)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_resend_lock = threading.RLock()  # re-entrant: a second SIGTERM may run the handler inside the first
_resend_pending = False


def _resend(signum: int) -> None:
    global _resend_pending
    with _resend_lock:
        _resend_pending = False
    os.kill(os.getpid(), signum)


def _resend_later(signum: int) -> None:
    """Send ``signum`` to this process again in :data:`RESEND_S` (once, however often it is asked)."""
    global _resend_pending
    with _resend_lock:
        if _resend_pending:
            return
        _resend_pending = True
    timer = threading.Timer(RESEND_S, _resend, args=(signum,))
    timer.daemon = True
    timer.start()


def _raise_terminated(signum: int, frame: Any) -> None:
    if _importing(frame):
        _resend_later(signum)
        return
    raise Terminated(128 + signum)


def install_sigterm_handler() -> None:
    """Make SIGTERM raise :class:`Terminated`, outside imports (module docstring). Call it before
    running a flow in a process you own (the CLI, the demo, tests, benchmarks); main thread only."""
    signal.signal(signal.SIGTERM, _raise_terminated)


def exit_on_sigterm(message: str) -> None:
    """Until the next :func:`install_sigterm_handler`, SIGTERM writes ``message`` to stderr and
    ends the process at once with status 143, running no cleanup: for a command's start, while
    it holds nothing (module docstring). Main thread only."""
    line = (message.rstrip("\n") + "\n").encode()

    def _exit_now(signum: int, frame: Any) -> None:
        try:
            os.write(2, line)
        except OSError:
            pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _exit_now)
