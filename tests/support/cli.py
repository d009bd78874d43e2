"""The ``ppoflow`` command line as a user runs it: the console script in a subprocess.

:func:`ppoflow_command` is the one place that says how the tests invoke the CLI; :class:`CLIRun`
starts it with its own Prefect home and device slots, keeps its output in a file, and watches its
process tree (what it started, even briefly: a check that no rank ever started).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.paths import ROOT
from tests.support.processes import descendants

__all__ = ["ppoflow_command", "cli_env", "CLIRun"]


def ppoflow_command(*args: str) -> list[str]:
    """The command line of ``ppoflow ARGS``: the installed console script next to this Python."""
    return [os.path.join(os.path.dirname(sys.executable), "ppoflow"), *args]


def cli_env(prefect_home: Path, slots: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI run: this one without a Prefect API or fault drills, a Prefect home
    and device slots of its own, this checkout first on the import path, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PPOFLOW_FAULT"))}
    env.update(
        PREFECT_HOME=str(prefect_home),
        PPOFLOW_SLOTS_DIR=str(slots),
        PPOFLOW_DEVICE_SLOTS="2",
        PYTHONPATH=ROOT,
        **extra,
    )
    return env


class CLIRun:
    """``ppoflow ARGS`` running in a subprocess (output to ``log``); ``seen`` collects
    ``{pid: command line}`` of every process below it, sampled every 0.25 s while it runs."""

    def __init__(self, log: Path, env: dict[str, str], *args: str):
        self.log = log
        self.out = open(log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            ppoflow_command(*args), env=env, stdout=self.out, stderr=subprocess.STDOUT, cwd=ROOT
        )
        self.seen: dict[int, str] = {}
        self.errors: list[str] = []
        self._watch = threading.Thread(target=self._watch_tree, daemon=True)
        self._watch.start()

    def _watch_tree(self) -> None:
        while self.proc.poll() is None:
            try:
                for pid, cmd in descendants(self.proc.pid).items():
                    if cmd or pid not in self.seen:  # an exiting process shows no command line
                        self.seen[pid] = cmd
            except Exception as exc:  # noqa: BLE001 - a process table read mid-change: look again
                self.errors.append(repr(exc))
            time.sleep(0.25)

    def text(self) -> str:
        return self.log.read_text()

    def finish(self, timeout: float = 600) -> tuple[int, float]:
        """(exit status, seconds since the start) once it has exited."""
        rc = self.proc.wait(timeout)
        took = time.monotonic() - self.t0
        self._watch.join(timeout=5)
        self.out.close()
        return rc, took

    def started(self, *needles: str) -> list[str]:
        """The processes it started whose command line holds one of ``needles``."""
        return sorted(c for c in self.seen.values() if any(n in c for n in needles))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.out.closed:
            self.out.close()
