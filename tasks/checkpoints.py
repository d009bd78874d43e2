"""The driver's record of the checkpoints a flow run writes in the background, and how it waits.

An update task of iteration n hands its state to the group's background writer
(:class:`~ppoflow.infra.checkpoint.writer.CheckpointWriter`) and returns; the run records the
write here (:meth:`Writes.started`) with its *lineage*: the checkpoint it started from, the update
method and the batch it ran. ``commit n`` then waits for checkpoint n (:meth:`Writes.wait`): the
write is over when the marker is on storage (complete), ``ppoflow_failed.json`` is (its retries
failed), the ranks say it failed (when storage could not take the failure record either), or the
group that wrote it died (torchrun exits when a rank dies).

A lost write is not fatal: because an update is deterministic given its starting checkpoint (that
is what makes resume bit-exact), the run recomputes the lost checkpoint from its lineage: load the
previous checkpoint, run the update on the same batch, save (``RunContext.materialize``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppoflow.infra.checkpoint.marker import is_complete, read_failure
from ppoflow.infra.remote.contracts import TrainedContract

__all__ = ["Lineage", "Writes"]


@dataclass(frozen=True)
class Lineage:
    """How checkpoint ``url`` of ``role`` came about: ``method`` (a DP_COMPUTE_PROTO update) run on
    ``data_url`` from checkpoint ``previous``, then saved with ``extra``."""

    role: str
    url: str
    previous: str
    method: str
    data_url: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Write:
    lineage: Lineage
    group: Any  # the WorkerGroup writing it
    started: float
    asked: float = 0.0  # when its ranks were last asked how the write goes


class Writes:
    """Background checkpoint writes of one flow run (thread-safe)."""

    def __init__(self, timeout_s: float = 3600.0, check: Callable[[], None] | None = None) -> None:
        """``check``: called while waiting; what it raises ends the wait (the run's lock check)."""
        self.timeout_s = timeout_s
        self.check = check
        self._writes: dict[str, _Write] = {}
        self._lineage: dict[str, Lineage] = {}
        self._lock = threading.Lock()

    def started(self, lineage: Lineage, group: Any, background: bool) -> None:
        """Record that ``group`` now writes (``background``) or wrote checkpoint ``lineage.url``."""
        with self._lock:
            self._lineage[lineage.url] = lineage
            if background:
                self._writes[lineage.url] = _Write(lineage, group, time.monotonic())
            else:
                self._writes.pop(lineage.url, None)

    def lineage(self, url: str) -> Lineage | None:
        with self._lock:
            return self._lineage.get(url)

    def wait_quietly(self, url: str) -> None:
        """If this run is writing ``url``, wait until that write is over (however it ends)."""
        with self._lock:
            ours = url in self._writes
        if ours:
            self.wait(url, self.timeout_s)

    def wait(self, url: str, timeout_s: float | None = None) -> str | None:
        """Wait until checkpoint ``url`` is complete; None then, else why it will not be.

        A URL this run is not writing is only checked for completeness.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            if is_complete(url):
                with self._lock:
                    self._writes.pop(url, None)
                return None
            failure = read_failure(url)
            if failure:
                return f"its background write failed: {failure}"
            with self._lock:
                write = self._writes.get(url)
            if write is None:
                return "no write of it finished, and none is running in this flow run"
            if not write.group.alive:
                if is_complete(url):  # published just before the group went away
                    continue
                return f"the {write.lineage.role} group died while writing it"
            if self.check is not None:
                self.check()
            failure = self._ask_ranks(write, url)
            if failure:
                return f"its background write failed: {failure}"
            if time.monotonic() > deadline:
                return f"its background write did not finish within {timeout_s:.0f} s"
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)

    def _ask_ranks(self, write: _Write, url: str) -> str | None:
        """The ranks' own word on the write of ``url`` when storage says nothing: a write that
        failed where its failure record could not be written either (a full disk, a lost
        connection) is over, and only the ranks know. Asked at most once a second, and only when
        the group is between calls (a task using it is not held up)."""
        now = time.monotonic()
        if now - write.asked < 1.0 or not hasattr(write.group, "call_if_idle"):
            return None
        write.asked = now
        try:
            idle, per_rank = write.group.call_if_idle(TrainedContract.checkpoint_write_status)
        except Exception:  # noqa: BLE001 - a dead group is reported by the loop's liveness check
            return None
        if not idle:
            return None
        errors = [s["error"] for s in per_rank or [] if s and s.get("url") == url and s.get("error")]
        return "; ".join(dict.fromkeys(errors)) or None
