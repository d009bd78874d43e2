"""The trainer's side of asynchronous training around a ``ppo`` flow run (docs/async.md).

:func:`rollout_queue` holds the run's iterations: first the queue is made to agree with the
committed state (``ppoflow.infra.queue.control.reconcile``: what updates that never committed
published, and what they sampled, goes) and the stop marker of the last run is removed; with
``asynchronous.producer.start: with_trainer`` the ``ppo-rollout`` flow is started in a process of
its own (:class:`ProducerProcess`, reporting to the same Prefect API, its output in the trainer's
log); at the end the stop marker is written and that process stopped (SIGTERMed at once when the
run failed or was interrupted: what it sampled is on storage already).

Why a process and not a thread of this one: the producer's flow process runs Python for every
engine call (the chunk loop, Arrow in and out) and the trainer's runs the advantage math and
Prefect's task runner; in one process they would share one interpreter lock. A process of its own
is also what runs on a generation host with its own work pool (``start: external``), can be killed
and started again on its own (the leases hand its batch to the next one), and ends with the trainer
(it watches the trainer's pid).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from ppoflow.flows.session import ExperimentSession
from ppoflow.infra import faults
from ppoflow.infra.experiment.manifest import record_config
from ppoflow.infra.queue.control import reconcile, request_stop
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.remote.procs import OutputPump, kill_process_group

__all__ = ["rollout_queue", "ProducerProcess", "ProducerFailed"]


#: How long a producer SIGTERMed by a failed or interrupted trainer run may take to end.
STOP_NOW_S = 20.0


class ProducerFailed(RuntimeError):
    """The rollout producer the trainer started kept dying."""


class ProducerProcess:
    """``python -m ppoflow.flows.rollout CONFIG --until N --owner-pid PID``, watched: a producer
    that exits before it is stopped is started again (at most ``restarts`` times in a run)."""

    def __init__(self, config_url: str, until: int, log: Any, restarts: int = 3):
        self.config_url, self.until, self.log = config_url, until, log
        self.restarts, self.started = restarts, 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: OutputPump | None = None
        self.stopping = False

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ppoflow.flows.rollout",
            self.config_url,
            "--until",
            str(self.until),
            "--owner-pid",
            str(os.getpid()),
        ]

    def start(self) -> None:
        from prefect.settings import PREFECT_API_URL

        env = dict(os.environ)
        if self.started:  # a producer started again: no kill drill fires twice
            env[faults.ENV_VAR] = faults.without_kills(env.get(faults.ENV_VAR))
        api = PREFECT_API_URL.value()
        if api:
            env["PREFECT_API_URL"] = str(api)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.pump = OutputPump(self.proc.stdout, lambda line: self.log(f"[producer] {line}"))
        self.pump.start()
        self.started += 1
        self.log(f"rollout producer started (pid {self.proc.pid}, up to batch {self.until})")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def check(self) -> None:
        """Start the producer again if it exited before it was stopped (ProducerFailed once it
        has died ``restarts`` times)."""
        if self.proc is None or self.stopping or self.proc.poll() is None:
            return
        code = self.proc.returncode
        tail = self.pump.tail(20) if self.pump is not None else ""
        if self.started > self.restarts:
            raise ProducerFailed(
                f"the rollout producer exited with status {code} {self.started} times; its last "
                f"output:\n{tail}"
            )
        self.log(f"the rollout producer exited with status {code}; starting it again")
        self.start()

    def stop(self, timeout_s: float = 120.0, now: bool = False) -> None:
        """Wait for the producer to end after the stop marker (killed after ``timeout_s``);
        ``now`` (the trainer's run failed or was interrupted): SIGTERM it at once, as its owner's
        exit would, and kill it after ``STOP_NOW_S`` (what it sampled is on storage already)."""
        self.stopping = True
        if self.proc is None:
            return
        if now and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            timeout_s = min(timeout_s, STOP_NOW_S)
        t0 = time.monotonic()
        while self.proc.poll() is None and time.monotonic() - t0 < timeout_s:
            time.sleep(0.2)
        if self.proc.poll() is None:
            self.log(f"the rollout producer did not stop within {timeout_s:.0f} s; killing it")
            kill_process_group(self.proc)
        if self.pump is not None:
            self.pump.join(timeout=5)


@contextlib.contextmanager
def rollout_queue(session: ExperimentSession, iterations: int) -> Iterator[None]:
    """The queue around a trainer's run of ``iterations`` after the manifest the session opened
    (none: a new experiment, iteration 0); module docstring. The producer starts first, so its
    start (a process, a worker group, an engine) overlaps the trainer's."""
    cfg = session.cfg
    if not cfg.asynchronous.enable or not iterations:
        yield
        return
    committed = session.manifest.iteration if session.manifest is not None else 0
    queue = QueuePaths(session.paths.root)
    removed = reconcile(queue, committed)
    if removed["versions"] or removed["batches"]:
        session.logger.info(
            f"rollout queue: removed policy versions {removed['versions']} and batches {removed['batches']} "
            f"(beyond committed iteration {committed})"
        )
    producer = None
    if cfg.asynchronous.producer.start == "with_trainer":
        producer = ProducerProcess(
            record_config(session.paths, cfg), committed + iterations, session.logger.info
        )
        producer.start()
        session.ctx.producer = producer
    ended = False
    try:
        yield
        ended = True
    finally:
        request_stop(queue, "the trainer's run ended", after=committed + iterations)
        if producer is not None:
            session.ctx.producer = None
            producer.stop(now=not ended)  # failed or interrupted (Ctrl-C): no graceful wait
