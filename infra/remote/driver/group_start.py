"""A worker group's start, as the driver sees it: taking every rank's link and hello from the
launcher within the connect timeout, and telling a start that failed for good from one a retry
may fix.

A start fails when the launcher reports an end before every rank connected (torchrun exited, a
node was lost), when the ranks do not all connect within the timeout, or when a rank fails while
building its worker. :func:`classify` makes it a :class:`~ppoflow.infra.remote.errors.GroupCannotStart`
(not retried by the tasks) when a retry cannot change the outcome:

- the first rank to end exited with an error status (torchrun's "Root Cause" report shows an
  exit code > 0): it raised or exited by itself at start (an import, a bad environment variable,
  a device it cannot open), and a new start runs the same code in the same environment;
- a rank's worker class, or a module it needs, does not import (``ImportError``, or the class is
  missing: ``AttributeError``). Other errors a rank raises keep their class names in
  ``error_types``, for the caller's own rule (the tasks' retry rule reads them).

A rank killed by a signal (the kernel's OOM killer, an operator), a lost node and a connect
timeout (a machine busy for a while) stay :class:`~ppoflow.infra.remote.errors.RankFailure`: a
later start may succeed.
"""

from __future__ import annotations

import re
import time
from multiprocessing.connection import Connection
from typing import NoReturn, Protocol

from ppoflow.infra.remote.driver.launchers import Launcher
from ppoflow.infra.remote.errors import GroupCannotStart, RankFailure
from ppoflow.infra.remote.protocol import Hello

__all__ = ["accept_ranks", "classify", "root_cause", "START_METHODS"]

#: The ``method`` of a :class:`RankFailure` raised while a group starts: before every rank said
#: hello, and while the ranks build their workers.
START_METHODS = ("__start__", "__init__")

_ROOT = re.compile(
    r"Root Cause \(first observed failure\):.*?\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", re.S
)
_ERROR_LINE = re.compile(r"^\[rank(\d+)\]:\s?((?:[A-Za-z_][\w.]*)(?:Error|Exception|Exit)\b.*)$")
#: An exception's last line inside the report's own traceback (a forked rank's error file).
_REPORT_ERROR = re.compile(r"^\s*((?:[A-Za-z_][\w.]*)(?:Error|Exception|Exit)\b.*)$")


class Fail(Protocol):
    """The group's ``_fail``: kill the group and raise RankFailure."""

    def __call__(
        self, what: str, rank: int | None, method: str, with_tail: bool, settle: bool = False
    ) -> NoReturn: ...


def accept_ranks(
    launcher: Launcher, nprocs: int, timeout_s: float, fail: Fail, conns: list[Connection]
) -> dict[int, Hello]:
    """Take the ``nprocs`` rank links and hellos from ``launcher`` within ``timeout_s``: each link
    goes into ``conns`` as it comes (so a failed start closes it), which ends ordered by rank; the
    hellos are returned by rank. A launcher that reports an end first, a rank that closes its link,
    or the time running out fail the start through ``fail``."""
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Connection] = {}
    hellos: dict[int, Hello] = {}
    while len(by_rank) < nprocs:
        now, cause = time.monotonic(), launcher.failure()
        if now > deadline:
            cause = f"only {len(by_rank)}/{nprocs} ranks connected within {timeout_s:g} s"
        elif cause is not None:
            cause += f" before all ranks connected ({len(by_rank)}/{nprocs} had)"
        if cause is not None:
            fail(cause + launcher.missing(hellos), None, "__start__", with_tail=True)
        try:
            got = launcher.poll_hello(min(0.2, deadline - now))
        except EOFError as err:
            fail(str(err), None, "__start__", with_tail=True, settle=True)
        if got is not None:
            conn, hello = got
            conns.append(conn)
            by_rank[hello.rank] = conn
            hellos[hello.rank] = hello
    conns[:] = [by_rank[r] for r in range(nprocs)]
    return hellos


def root_cause(output: str) -> tuple[int, int, str] | None:
    """``(rank, exit code, its last error line)`` of the first rank to end, from torchrun's failure
    report in ``output``; None without a report. The error line: the rank's own (a spawned rank
    prints its traceback), else the one in the report (a forked rank's traceback is there), else
    another rank's, else ""."""
    found = list(_ROOT.finditer(output))
    if not found:
        return None
    rank, code = int(found[-1].group(1)), int(found[-1].group(2))
    errors: dict[int, str] = {}  # each rank's last error line
    for line in output.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if m:
            errors[int(m.group(1))] = m.group(2).strip()
    reported = ""
    for line in output[found[-1].end() :].splitlines():
        if line.startswith("====="):  # the report's end
            break
        m = _REPORT_ERROR.match(line)
        if m:
            reported = m.group(1).strip()
    return rank, code, errors.get(rank) or reported or next(reversed(errors.values()), "")


def classify(exc: RankFailure, output: str) -> RankFailure:
    """``exc`` (a failed start) as a :class:`GroupCannotStart` when a retry cannot change the
    outcome (the module docstring), else ``exc`` itself. ``output``: the launcher's output tail."""
    if exc.method not in START_METHODS or isinstance(exc, GroupCannotStart):
        return exc
    text = str(exc)
    if exc.error_types:  # a rank raised while building its worker
        if not exc.raised(ImportError, AttributeError):
            return exc
        head, sep, tail = text.partition("\n--- ")
        why = "the worker class, or a module it needs, does not import: a new start fails the same way"
        return GroupCannotStart(f"{head}\n{why}{sep}{tail}", exc.rank, exc.method, exc.error_types)
    cause = root_cause(output)
    if cause is None or cause[1] <= 0:  # no report, or killed by a signal (e.g. out of memory)
        return exc
    rank, code, error = cause
    head, sep, tail = text.partition("\n--- ")
    said = f"rank {rank} exited with status {code} while starting" + (f": {error}" if error else "")
    return GroupCannotStart(
        f"{head}\n{said}\na new start runs the same code in the same environment and fails the same "
        f"way: fix the cause above{sep}{tail}",
        rank,
        exc.method,
    )
