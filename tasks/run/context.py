"""What one flow run keeps across its iterations, under the run's key.

Prefect task parameters must be hashable, JSON-able values, so tasks never receive a live worker
group: the flow's session opens a :class:`RunContext` under a string key (its flow run id) and
passes the key; each task looks the context up with :func:`get_run`. The contexts live in this
process's registry, so **a ppoflow task runs in the process of the flow that opened its run**
(Prefect's default thread-pool task runner; a task runner that runs tasks in other processes or
on other machines finds no run, and :func:`get_run` says so). A context is made of

- ``groups``  (:class:`~ppoflow.tasks.run.groups.RunGroups`): the worker groups and the
  checkpoint each holds;
- ``inputs``  (:class:`~ppoflow.tasks.run.inputs.RunInputs`): the tokenizer and the dataset;
- ``writes``  (:class:`~ppoflow.tasks.checkpoints.Writes`): the checkpoints being written in the
  background;
- what the session passed in as it opened it: ``lock`` (the experiment lock the run holds, None
  for a reader), ``rollouts`` (:class:`~ppoflow.tasks.run.rollouts.RolloutSource`: where its
  iterations' rollouts come from) and ``storage`` (:class:`~ppoflow.infra.data.storage.RunStorage`:
  the run's root and storage options); and the routing of rank output into the log of the task
  currently using a group (:meth:`RunContext.using`; else the flow's logger).

A context is fixed once it opens: none of its attributes is set again (the objects they hold
keep their own state: the groups start and stop, the lock renews its lease).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data.storage import RunStorage
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.remote.contracts import Build, WorkerMode
from ppoflow.tasks.checkpoints import Writes
from ppoflow.tasks.run.groups import RunGroups
from ppoflow.tasks.run.inputs import RunInputs
from ppoflow.tasks.run.rollouts import SYNCHRONOUS, RolloutSource

__all__ = ["RunContext", "open_run", "get_run", "close_run", "abort_run", "worker_groups"]

_LOG = logging.getLogger("ppoflow.flow")


class RunContext:
    """Flow-run-scoped state shared by the tasks (see the module docstring)."""

    def __init__(
        self,
        key: str,
        cfg: ExperimentConfig,
        log: Any = None,
        roles: Mapping[str, Build | WorkerMode | str] | None = None,
        *,
        lock: ExperimentLock | None = None,
        rollouts: RolloutSource = SYNCHRONOUS,
        storage: RunStorage | None = None,
    ):
        self.key, self.cfg = key, cfg
        self.paths = ExperimentPaths.of(cfg)
        self.log = log or _LOG
        self.lock, self.rollouts = lock, rollouts
        self.storage = storage or RunStorage(cfg.storage.root, cfg.storage.storage_options)
        self.pid = os.getpid()  # the process whose registry holds it
        self._sinks: dict[str, Any] = {}
        # a wait for a write also ends when this run loses its experiment lock
        self.writes = Writes(timeout_s=cfg.checkpoint.wait_timeout_s, check=self.check_lock)
        self.inputs = RunInputs(cfg)
        self.groups = RunGroups(key, cfg, self.paths, self.writes, self._emit, self.log, roles)
        self._fixed = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_fixed", False):
            raise AttributeError(
                f"the context of run {self.key} is fixed once it opens: {name!r} is given to "
                "RunContext(...) by the session that opens it (ppoflow.flows.session)"
            )
        super().__setattr__(name, value)

    def check_lock(self) -> None:
        """Raise if this run lost its experiment lock (a reader holds none)."""
        if self.lock is not None:
            self.lock.check()

    def check_rollouts(self) -> None:
        """While a task waits for a rollout: raise if this run lost its lock, and let the rollout
        source say whether it can still deliver (asynchronous training: its producer is started
        again if it died, or it raises)."""
        self.check_lock()
        self.rollouts.check()

    @property
    def closed(self) -> bool:
        return self.groups.closed

    def _emit(self, role: str, line: str) -> None:
        sink = self._sinks.get(role) or self.log
        try:
            sink.info(line)
        except Exception:  # noqa: BLE001 - a closed task logger must not kill the output pump
            _LOG.info(line)

    @contextlib.contextmanager
    def using(self, role: str, logger: Any) -> Iterator[None]:
        """Route ``role``'s rank output to ``logger`` (a task's run logger) inside the block."""
        self._sinks[role] = logger
        try:
            yield
        finally:
            self._sinks.pop(role, None)


_RUNS: dict[str, RunContext] = {}
_RUNS_LOCK = threading.Lock()


def open_run(
    key: str,
    cfg: ExperimentConfig,
    log: Any = None,
    roles: Mapping[str, Build | WorkerMode | str] | None = None,
    *,
    lock: ExperimentLock | None = None,
    rollouts: RolloutSource = SYNCHRONOUS,
    storage: RunStorage | None = None,
) -> RunContext:
    """Create the context of flow run ``key`` in this process's registry, with what the session
    passes in (:class:`RunContext`); ``roles``: see :class:`~ppoflow.tasks.run.groups.RunGroups`."""
    with _RUNS_LOCK:
        if key in _RUNS and not _RUNS[key].closed:
            raise RuntimeError(f"flow run {key} already has an open context")
        ctx = _RUNS[key] = RunContext(key, cfg, log, roles, lock=lock, rollouts=rollouts, storage=storage)
        return ctx


def _elsewhere(key: str) -> RuntimeError:
    return RuntimeError(
        f"no open ppoflow run {key!r}: ppoflow tasks run inside the `ppo` flow, in the flow's own "
        f"process (pid {os.getpid()} has no such run): the run's worker groups, lock and inputs live "
        "there. Run the flow with Prefect's default task runner (threads), not one that runs tasks "
        "in other processes or on other machines"
    )


def get_run(key: str) -> RunContext:
    """The context of flow run ``key``, opened by the flow in this very process (module docstring:
    tasks run in their flow's process); a clear error otherwise (no such run here, or a process
    forked from the flow's, whose copy of the registry no flow keeps)."""
    ctx = _RUNS.get(key)
    if ctx is None or ctx.pid != os.getpid():
        raise _elsewhere(key)
    return ctx


def close_run(key: str) -> None:
    """Shut the run's groups down and forget it."""
    with _RUNS_LOCK:
        ctx = _RUNS.pop(key, None)
    if ctx is not None:
        ctx.groups.shutdown()


def abort_run(key: str) -> None:
    """Kill the run's groups at once (an interrupt); :func:`close_run` still forgets the run."""
    with _RUNS_LOCK:
        ctx = _RUNS.get(key)
    if ctx is not None:
        ctx.groups.kill()


@contextlib.contextmanager
def worker_groups(key: str) -> Iterator[None]:
    """The span in which run ``key``'s worker groups may live: at its end they are shut down
    cleanly; on an interrupt (Ctrl-C, SIGTERM: a ``BaseException`` that is not an ``Exception``)
    they are killed first, so a task blocked on a rank cannot delay the exit."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            abort_run(key)
        raise
    finally:
        close_run(key)
