"""Asynchronous training's :class:`~ppoflow.tasks.run.rollouts.RolloutSource`: the queue
(:class:`QueueSource`), and :func:`rollout_source`, the one place that picks a run's source.

The ``ppo`` flow's session holds it for the run:

- ``start(committed)`` as the session opens: the queue is made to agree with the committed state
  (``ppoflow.infra.queue.control.reconcile``: what updates that never committed published, and
  what they sampled, goes) and the last run's stop marker is removed; with
  ``asynchronous.producer.start: with_trainer`` the ``ppo-rollout`` flow starts in a process of
  its own (:class:`~ppoflow.flows.asynchronous.producer.ProducerProcess`), on the trainer's
  devices, so its start (a process, a worker group, an engine) overlaps the trainer's;
- ``check()`` while ``consume`` waits for a batch: a producer that died is started again;
- ``after_commit(n)`` from ``commit n``: the consumed batches and old policy versions go;
- ``stop(failed)`` as the session closes, before the groups: the stop marker is written and the
  producer stopped (SIGTERMed at once when the run failed or was interrupted: what it sampled is
  on storage already).
"""

from __future__ import annotations

from typing import Any

from ppoflow.flows.asynchronous.producer import ProducerProcess
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.experiment.manifest import ExperimentPaths, record_config
from ppoflow.infra.queue.control import reconcile, request_stop, retain
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.tasks.run import SYNCHRONOUS, RolloutSource

__all__ = ["QueueSource", "rollout_source", "memory_advice"]


class QueueSource:
    """The trainer's side of the rollout queue for a run of ``iterations`` (module docstring);
    ``log``: where its lines go (the flow's logger's ``info``)."""

    def __init__(self, cfg: ExperimentConfig, iterations: int, log: Any):
        self.cfg, self.iterations, self.log = cfg, iterations, log
        self.paths = ExperimentPaths.of(cfg)
        self.queue = QueuePaths(self.paths.root)
        self.until: int | None = None
        self.producer: ProducerProcess | None = None

    def start(self, committed: int) -> None:
        """Reconcile the queue with manifest ``committed`` and start the producer (if the trainer
        starts it) for the batches up to ``committed + iterations``."""
        self.until = committed + self.iterations
        removed = reconcile(self.queue, committed)
        if removed["versions"] or removed["batches"]:
            self.log(
                f"rollout queue: removed policy versions {removed['versions']} and batches "
                f"{removed['batches']} (beyond committed iteration {committed})"
            )
        if self.cfg.asynchronous.producer.start == "with_trainer":
            self.producer = ProducerProcess(record_config(self.paths, self.cfg), self.until, self.log)
            self.producer.start()

    def check(self) -> None:
        if self.producer is not None:
            self.producer.check()

    def after_commit(self, n: int) -> list[str]:
        return [f"queue/{ref}" for ref in retain(self.queue, n)]

    def stop(self, failed: bool) -> None:
        """The stop marker, then the producer's end (at once when ``failed``)."""
        if self.until is None:
            return  # never started
        try:
            request_stop(self.queue, "the trainer's run ended", after=self.until)
        finally:
            if self.producer is not None:
                self.producer.stop(now=failed)  # failed or interrupted (Ctrl-C): no graceful wait


def rollout_source(cfg: ExperimentConfig, iterations: int, log: Any) -> RolloutSource:
    """Where a ``ppo`` run of ``iterations`` takes its rollouts: the queue with
    ``asynchronous.enable`` (and iterations to run), else each iteration's ``generate``."""
    if cfg.asynchronous.enable and iterations:
        return QueueSource(cfg, iterations, log)
    return SYNCHRONOUS


def memory_advice(cfg: ExperimentConfig) -> str:
    """What asynchronous training adds to the advice for a run out of device memory ("" without it)."""
    if not cfg.asynchronous.enable:
        return ""
    return (
        "; with asynchronous training the producer's engine stays awake beside the updates: on "
        "one device it needs that room too, or place the producer on another device "
        "(asynchronous.producer, docs/async.md#where-the-groups-run)"
    )
