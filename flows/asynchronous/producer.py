"""The rollout producer the trainer starts: the ``ppo-rollout`` flow in a process of its own,
watched (:class:`ProducerProcess`).

Why a process and not a thread of the trainer's: the producer's flow process runs Python for every
engine call (the chunk loop, Arrow in and out) and the trainer's runs the advantage math and
Prefect's task runner; in one process they would share one interpreter lock. A process of its own
is also what runs on a generation host with its own work pool (``start: external``), can be killed
and started again on its own (the leases hand its batch to the next one), and ends with the trainer
(it watches the trainer's pid).

It reports to the trainer's Prefect API and its output goes into the trainer's log. It ends as any
flow run does: at the stop marker its flow returns, or on SIGTERM (from here, or when it sees the
trainer gone) Prefect ends it as crashed; its process then exits normally.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from ppoflow.infra.remote.procs import OutputPump, kill_process_group
from ppoflow.infra.runtime import faults

__all__ = ["ProducerProcess", "ProducerFailed", "PRODUCER_MODULE"]

#: What the producer's process runs (``python -m``): the ``ppo-rollout`` flow.
PRODUCER_MODULE = "ppoflow.flows.asynchronous.rollout"


#: How long a producer SIGTERMed by a failed or interrupted trainer run may take to end.
STOP_NOW_S = 20.0


class ProducerFailed(RuntimeError):
    """The rollout producer the trainer started kept dying."""


class ProducerProcess:
    """``python -m ppoflow.flows.asynchronous.rollout CONFIG --until N --owner-pid PID``, watched: a producer
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
            PRODUCER_MODULE,
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
