"""The ``ppo-rollout`` flow: the rollout producer of asynchronous training (docs/async.md).

    from ppoflow.flows.asynchronous.rollout import ppo_rollout
    ppo_rollout("experiment.yaml", until=20)   # or: python -m ppoflow.flows.asynchronous.rollout CONFIG

It samples the batches of the iterations ahead into the experiment's rollout queue, one ``produce``
task per batch (retried, a retry resumes from the batch's published parts), on a worker group of
its own (role ``rollout``: the engine and a copy of the policy, no optimizer), placed by
``asynchronous.producer`` (its ranks, device, visible GPUs). Which batch next: the lowest one its
admission admits (:mod:`ppoflow.infra.queue.admission`; by default batch k once version
``k - 1 - max_staleness`` is published, so the producer never runs further ahead than the bound)
that has no record and no live producer's lease.

It runs until batch ``until`` is sampled, a trainer's stop marker appears (``queue/stop.json``,
written at the end of every trainer run; one older than the producer is ignored), or, when the
trainer started it (``owner_pid``), the trainer's process is gone (then it ends as on SIGTERM).
Its process ends as a flow run's does: the flow returns (or raises), and ``main`` returns. Several producers may run at once: the leases keep them on different
batches. A producer the trainer started takes no device slots of its own (it runs on the trainer's
devices: on one GPU both groups share it); an external one (its own deployment and work pool)
takes its host's.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from typing import Any

from prefect import flow, get_run_logger

from ppoflow.flows.asynchronous.produce import produce
from ppoflow.flows.session import ExperimentSession, flow_run_key, resolve_config
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.experiment.manifest import Manifest, read_manifest
from ppoflow.infra.queue.admission import Admission, admission_of
from ppoflow.infra.queue.batches import BatchClaim, claim_holder, read_record
from ppoflow.infra.queue.control import stop_requested
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions
from ppoflow.infra.remote.procs import block_until_exit
from ppoflow.tasks.step import with_retries

__all__ = ["ppo_rollout", "Producer"]


class Producer:
    """The producer's choice of batches and their prompts (module docstring); ``admission``:
    which batches it may start (None: the one the config names)."""

    def __init__(self, session: ExperimentSession, until: int | None, admission: Admission | None = None):
        self.session, self.ctx, self.until = session, session.ctx, until
        self.cfg = session.cfg
        self.admission = admission or admission_of(self.cfg.asynchronous)
        self.queue = QueuePaths(session.paths.root)
        self.versions = PolicyVersions(self.queue)
        self._cursors: dict[int, DataCursor] = {}
        self.produced: list[int] = []
        self.started_at = time.time()

    def stopped(self, manifest: Manifest | None = None) -> bool:
        """A stop marker written since this producer started is there (an older one is a past
        trainer run's), or the committed iteration reached ``until``."""
        marker = stop_requested(self.queue)
        if marker is not None and float(marker.get("at", 0.0)) >= self.started_at:
            return True
        return self.until is not None and manifest is not None and manifest.iteration >= self.until

    def cursor(self, k: int, manifest: Manifest) -> DataCursor:
        """The data cursor of batch ``k``: the chain of batches from the manifest the producer first
        read (its stream opened as the trainer's run opened it)."""
        if not self._cursors:
            stream = self.ctx.inputs.open_stream(self.session.paths.root, self.session.key, manifest)
            self._cursors[manifest.iteration + 1] = stream.start_cursor(
                manifest.data_cursor, manifest.iteration
            )
        data = self.cfg.data
        while k not in self._cursors:
            last = max(self._cursors)
            if last > k:
                raise RuntimeError(f"batch {k} comes before this producer's first batch {min(self._cursors)}")
            _, self._cursors[last + 1] = self.ctx.inputs.dataset.take(
                self._cursors[last], data.train_batch_size, seed=data.seed, shuffle=data.shuffle
            )
        return self._cursors[k]

    def _free(self, k: int) -> bool:
        """Batch ``k`` has no record and no live producer's lease."""
        if read_record(self.queue, k) is not None:
            return False
        holder = claim_holder(self.queue, k)
        if holder is None:
            return True
        probe = BatchClaim(
            self.queue.claim(k), self.session.key, stale_after_s=self.cfg.asynchronous.lease_stale_after_s
        )
        return probe.stale_reason(holder) is not None

    def next_batch(self) -> tuple[int, Manifest] | None:
        """The next batch to sample, once the policy it needs is published; None: stop."""
        a = self.cfg.asynchronous
        while True:
            manifest = read_manifest(self.session.paths)
            if self.stopped(manifest):
                return None
            latest = self.versions.latest()
            if manifest is not None:
                version = None if latest is None else latest.version
                for k in self.admission.admissible(manifest.iteration, version, self.until):
                    if self._free(k):
                        return k, manifest
            time.sleep(a.poll_s)

    def run(self) -> list[int]:
        """Sample batches until told to stop; the batches this producer published."""
        self.ctx.groups.prestart(["actor"])
        while (found := self.next_batch()) is not None:
            k, manifest = found
            record = with_retries(produce, self.cfg.resources.task_retries)(
                self.session.key, k, self.cursor(k, manifest)
            )
            if record is not None and record.get("producer", {}).get("run") == self.session.key:
                self.produced.append(k)
        return self.produced


def _watch_owner(pid: int) -> None:
    """End this process (as SIGTERM would) once process ``pid`` (the trainer) is gone."""

    def watch() -> None:
        block_until_exit(pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ppoflow-owner-watch", daemon=True).start()


@flow(name="ppo-rollout", log_prints=False)
def ppo_rollout(
    config: ExperimentConfig | str, until: int | None = None, owner_pid: int | None = None
) -> dict[str, Any]:
    """Sample the rollout queue of the experiment ``config`` describes (asynchronous training).

    Args:
        config: the experiment config (``asynchronous.enable: true``), or a YAML path / fsspec URL.
        until: the last batch to sample (None: until the trainer's stop marker).
        owner_pid: the trainer's process when it started this one: it ends with it and uses the
            trainer's device slots.

    Returns:
        ``{experiment, produced}``: the batches this run published.
    """
    cfg = resolve_config(config)
    if not cfg.asynchronous.enable:
        raise ConfigError(
            "the ppo-rollout flow samples for asynchronous training: set asynchronous.enable=true"
        )
    if owner_pid is not None:
        _watch_owner(owner_pid)
    logger = get_run_logger()
    session = ExperimentSession(
        cfg.producer_config(),
        logger,
        flow_run_key(),
        roles={"actor": "rollout"},
        lock=False,
        preflight=False,
        slots=owner_pid is None,
    )
    with session:
        produced = Producer(session, until).run()
    logger.info(f"rollout producer done: published batches {produced or 'none'}")
    return {"experiment": cfg.storage.experiment, "produced": produced}


def main(argv: list[str] | None = None) -> None:
    """``python -m ppoflow.flows.asynchronous.rollout CONFIG [--until N] [--owner-pid PID]``."""
    from ppoflow.infra.runtime.signals import install_stop_handlers

    parser = argparse.ArgumentParser(
        prog="python -m ppoflow.flows.asynchronous.rollout", description=ppo_rollout.__doc__
    )
    parser.add_argument("config")
    parser.add_argument("--until", type=int, default=None)
    parser.add_argument("--owner-pid", type=int, default=None)
    args = parser.parse_args(argv)
    install_stop_handlers()
    ppo_rollout(args.config, until=args.until, owner_pid=args.owner_pid)


if __name__ == "__main__":
    main()
