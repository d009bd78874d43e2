"""Where a run's iterations take their rollouts from: :class:`RolloutSource`, picked once per run.

Two exist: the synchronous one (:data:`SYNCHRONOUS`: the iteration's ``generate`` step samples
its own rollout, and there is nothing to start, tidy or stop) and asynchronous training's queue
(``ppoflow.flows.asynchronous``: a producer fills it ahead of the trainer, ``consume`` takes
from it). The session of a ``ppo`` flow run picks one and hands it to the run's context; from
then on it is the only place that knows which it is:

- :meth:`~RolloutSource.start` as the run opens, from the committed iteration (the queue: made to
  agree with the committed state, its producer started);
- :meth:`~RolloutSource.check` while a task waits for a rollout (the queue: its producer still
  runs, or is started again);
- :meth:`~RolloutSource.after_commit` after each commit (the queue: the consumed batches and old
  policy versions removed), what it removed;
- :meth:`~RolloutSource.stop` as the run closes (the queue: the stop marker, the producer ended,
  at once when the run failed).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["RolloutSource", "SynchronousRollouts", "SYNCHRONOUS"]


class RolloutSource(Protocol):
    """The run's rollouts (module docstring)."""

    def start(self, committed: int) -> None: ...
    def check(self) -> None: ...
    def after_commit(self, n: int) -> list[str]: ...
    def stop(self, failed: bool) -> None: ...


class SynchronousRollouts:
    """Each iteration samples its own rollout (the ``generate`` row): nothing to start or stop."""

    def start(self, committed: int) -> None:
        pass

    def check(self) -> None:
        pass

    def after_commit(self, n: int) -> list[str]:
        return []

    def stop(self, failed: bool) -> None:
        pass


#: The synchronous source (it holds nothing: one serves every run).
SYNCHRONOUS = SynchronousRollouts()
