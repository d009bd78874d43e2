"""SIGTERM and Ctrl-C that end a run cleanly, fast, and never half-way through an import.

Python's default SIGTERM action kills the process without running ``finally`` blocks or atexit
hooks; Prefect's handler (installed while a flow runs) raises its ``TerminationSignal`` and then
re-sends the signal to the handler that was there before. With :func:`install_stop_handlers`
that handler raises :class:`Terminated`, a ``SystemExit``: the flow kills its worker groups,
releases the experiment lock and the device slots, the local Prefect server is stopped, and
the process exits with status 143.

An exception raised by a signal handler lands wherever the main thread is, and a process start
is mostly imports. Raised inside one it was seen to go wrong twice (SIGTERM sent to the CLI at
random moments of its start): inside ``import torch.distributed`` (torch's
C++ calls back into Python) it became a C++ exception and the process aborted (``terminate called
after throwing an instance of 'pybind11::error_already_set'``, exit -6); inside a library's import
that catches everything, the signal was swallowed and the run went on to commit. A Ctrl-C
(SIGINT, Python's ``KeyboardInterrupt``) lands the same way. So, for both:

- :func:`exit_while_starting`, for the start of a command, before it holds anything: the signal
  prints one line and ends the process at once (``os._exit``, status 143 or 130). Nothing needs
  releasing yet; the local Prefect server's process ends with its parent
  (``ppoflow.cli.local_api``).
- :func:`install_stop_handlers`, for the rest: SIGTERM raises :class:`Terminated` and Ctrl-C
  ``KeyboardInterrupt``, except in the middle of an import: then the signal is re-sent to this
  process 0.1 s later, until it lands outside one.

This module imports nothing heavy, so the CLI installs its handlers before it imports torch,
Prefect or vLLM.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["Terminated", "exit_while_starting", "install_stop_handlers"]

RESEND_S = 0.1  # how long a signal that arrived mid-import waits before it is tried again
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


class Terminated(SystemExit):
    """SIGTERM, as raised by the handler of :func:`install_stop_handlers` (exit status 143)."""


def _importing(frame: FrameType | None) -> bool:
    """True when ``frame`` or one of its callers is the import machinery (a module being loaded)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_resend_lock = threading.RLock()  # re-entrant: a second signal may run a handler inside the first
_resend_pending: set[int] = set()


def _resend(signum: int) -> None:
    with _resend_lock:
        _resend_pending.discard(signum)
    os.kill(os.getpid(), signum)


def _resend_later(signum: int) -> None:
    """Send ``signum`` to this process again in :data:`RESEND_S` (once, however often it is asked)."""
    with _resend_lock:
        if signum in _resend_pending:
            return
        _resend_pending.add(signum)
    timer = threading.Timer(RESEND_S, _resend, args=(signum,))
    timer.daemon = True
    timer.start()


def _raise_stop(signum: int, frame: Any) -> None:
    if _importing(frame):
        _resend_later(signum)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(128 + signum)


def install_stop_handlers() -> None:
    """Make SIGTERM raise :class:`Terminated` and Ctrl-C ``KeyboardInterrupt``, outside imports
    (module docstring). Call it before running a flow in a process you own (the CLI, the demo,
    tests, benchmarks); main thread only."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stop)


def exit_while_starting(what: str) -> None:
    """Until :func:`install_stop_handlers`, SIGTERM or Ctrl-C writes "ppoflow: stopped by
    SIGTERM while starting (``what`` had not begun)" to stderr and ends the process at once with
    status 143 or 130, running no cleanup: for a command's start, while it holds nothing (module
    docstring). Main thread only."""
    lines: dict[int, bytes] = {
        signum: f"ppoflow: stopped by {name} while starting ({what} had not begun)\n".encode()
        for signum, name in STOP_SIGNALS.items()
    }

    def _exit_now(signum: int, frame: Any) -> None:
        try:
            os.write(2, lines[signum])
        except OSError:
            pass
        os._exit(128 + signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, _exit_now)
