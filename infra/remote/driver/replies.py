"""Waiting for the replies of one call on a worker group: one per rank, while watching the ranks'
links (EOF: a dead rank) and the launcher (torchrun's pidfd, the agents' links).

A rank that raises replies with its failure; the others get ``grace_s`` to answer (they may be
stuck in a collective with it), then the call fails with the first failure's traceback. A rank
whose link closes, a launcher that reports a death, or a call past its time limit fail the call
at once. Failing goes through the group's ``fail`` (which kills the group and raises
:class:`~ppoflow.infra.remote.errors.RankFailure`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Protocol, cast

from ppoflow.infra.remote.driver.launchers import Launcher
from ppoflow.infra.remote.protocol import ProtocolError, Ready, Reply, receive

__all__ = ["ReplyCollector", "log_shutdown_errors"]


class Fail(Protocol):
    """The group's ``_fail``: kill the group and raise RankFailure."""

    def __call__(
        self,
        what: str,
        rank: int | None,
        method: str,
        with_tail: bool,
        settle: bool = False,
        error_types: tuple[str, ...] = (),
    ) -> NoReturn: ...


class ReplyCollector:
    """The replies of one call of a group with links ``conns`` (module docstring)."""

    def __init__(
        self,
        conns: list[Connection],
        launcher: Launcher,
        grace_s: float,
        call_timeout_s: float | None,
        fail: Fail,
        rank_name: Callable[[int], str],
    ):
        self.conns, self.launcher, self.grace_s, self.call_timeout_s = (
            conns,
            launcher,
            grace_s,
            call_timeout_s,
        )
        self.fail, self.rank_name = fail, rank_name
        self.nprocs = len(conns)

    def collect(self, method: str, cid: int | None) -> dict[int, Reply | Ready]:
        """One reply per rank (:class:`Ready` after init, :class:`Reply` after a call). Watches the
        links (EOF: dead rank) and the launcher (torchrun's pidfd, the agents' links); after the
        first error reply waits ``grace_s`` for the rest, then kills the group."""
        conns = self.conns
        rank_of = {id(c): r for r, c in enumerate(conns)}
        pending = set(range(self.nprocs))
        replies: dict[int, Reply | Ready] = {}
        first_error: tuple[int, float] | None = None
        t0 = time.monotonic()
        while pending:
            timeout = self._wait_budget(method, pending, first_error, t0)
            if timeout is None:
                break
            watch: list[Any] = [conns[r] for r in sorted(pending)]
            if self.launcher.event_fd is not None:
                watch.append(self.launcher.event_fd)
            for obj in wait(watch, timeout):
                if isinstance(obj, int):
                    continue  # the launcher has news: handled below, after the links are drained
                rank = rank_of[id(obj)]
                msg = self._receive(cast(Connection, obj), rank, method, cid, first_error is not None)
                pending.discard(rank)
                if msg is None:
                    continue
                replies[rank] = msg
                if not msg.ok and first_error is None:
                    first_error = (rank, time.monotonic())
            cause = self.launcher.failure() if pending else None
            if cause is not None:
                if first_error is not None:
                    break  # report the traceback of the rank that raised
                self.fail(
                    f"{cause} during {method!r}; ranks {sorted(pending)} never replied",
                    min(pending),
                    method,
                    with_tail=True,
                )
        if first_error is not None:
            self._fail_raised(method, first_error[0], replies[first_error[0]], pending)
        return replies

    def _wait_budget(
        self, method: str, pending: set[int], first_error: tuple[int, float] | None, t0: float
    ) -> float | None:
        """How long the next wait for replies may take: 1 s, less near the grace period after a
        first error (None: it is over) or the call's time limit (which fails the call)."""
        timeout = 1.0
        if first_error is not None:
            timeout = first_error[1] + self.grace_s - time.monotonic()
            if timeout <= 0:
                return None
        if self.call_timeout_s is not None:
            left = t0 + self.call_timeout_s - time.monotonic()
            if left <= 0:
                self.fail(
                    f"{method} did not finish within {self.call_timeout_s} s "
                    f"(ranks still busy: {sorted(pending)})",
                    None,
                    method,
                    with_tail=True,
                )
            timeout = min(timeout, left)
        return timeout

    def _receive(
        self, conn: Connection, rank: int, method: str, cid: int | None, after_error: bool
    ) -> Reply | Ready | None:
        """The reply of ``rank`` to call ``cid`` (:class:`Ready` to the init). A closed link kills
        the group, unless another rank already raised (its traceback is what gets reported: None)."""
        try:
            msg = receive(conn, Ready) if cid is None else receive(conn, Reply)
        except (EOFError, OSError, ProtocolError) as err:
            if after_error:
                return None
            what = "sent a message that is not a reply" if isinstance(err, ProtocolError) else "died"
            self.fail(
                f"{self.rank_name(rank)} {what} during {method!r} ({err or 'its link closed'})",
                rank,
                method,
                with_tail=True,
                settle=True,
            )
        if isinstance(msg, Reply) and msg.id != cid:
            raise ProtocolError(f"rank {rank} answered call {msg.id} while call {cid} ({method}) was pending")
        return msg

    def _fail_raised(self, method: str, rank: int, msg: Reply | Ready, pending: set[int]) -> None:
        """Raise the RankFailure of ``rank``, which reported an exception (``msg.failure``)."""
        failure = msg.failure
        error, trace = (failure.error, failure.traceback) if failure else ("(no details)", "")
        stuck = f" (ranks {sorted(pending)} still busy after {self.grace_s} s)" if pending else ""
        self.fail(
            f"rank {rank} raised in {method!r}: {error}{stuck}\n--- rank {rank} traceback ---\n{trace.rstrip()}",
            rank,
            method,
            with_tail=False,
            error_types=tuple(failure.error_types) if failure else (),
        )


def log_shutdown_errors(conns: list[Connection], log: Callable[[str], None]) -> None:
    """Report (to ``log``) the ranks whose shutdown hook or process-group teardown failed (their
    replies to the :class:`~ppoflow.infra.remote.protocol.Shutdown`, read without waiting)."""
    for rank, conn in enumerate(conns):
        try:
            while conn.poll(0):
                msg = receive(conn, Reply)
                if not msg.ok and msg.failure is not None:
                    log(f"[ppoflow] rank {rank} shutdown: {msg.failure.error}")
        except (EOFError, OSError, ProtocolError):
            pass
