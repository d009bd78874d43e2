"""SIGTERM that ends a run the way Ctrl-C does: cleanly, and fast.

Python's default SIGTERM action kills the process without running ``finally`` blocks or atexit
hooks; Prefect's handler (installed while a flow runs) raises its ``TerminationSignal`` and then
re-sends the signal to the handler that was there before. With :func:`install_sigterm_handler`
that handler raises :class:`Terminated`, a ``SystemExit``: the flow kills its worker groups,
releases the experiment lock and the device slots, the temporary Prefect server is stopped, and
the process exits with status 143.

This module imports nothing heavy, so the CLI installs the handler before it imports torch,
Prefect or vLLM (a SIGTERM while starting exits cleanly too).
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["Terminated", "install_sigterm_handler"]


class Terminated(SystemExit):
    """SIGTERM, as raised by the handler of :func:`install_sigterm_handler` (exit status 143)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def install_sigterm_handler() -> None:
    """Make SIGTERM raise :class:`Terminated` (module docstring). Call it before running a flow in
    a process you own (the CLI, the demo, tests, benchmarks); main thread only."""
    signal.signal(signal.SIGTERM, _raise_terminated)
