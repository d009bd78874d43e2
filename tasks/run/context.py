"""What one flow run keeps across its iterations, under the run's key.

Prefect task parameters must be hashable, JSON-able values, so tasks never receive a live worker
group: the flow opens a :class:`RunContext` under a string key (its flow run id) and passes the
key; each task looks the context up with :func:`get_run`. A context is made of

- ``groups``  (:class:`~ppoflow.tasks.run.groups.RunGroups`): the worker groups and the
  checkpoint each holds;
- ``inputs``  (:class:`~ppoflow.tasks.run.inputs.RunInputs`): the tokenizer and the dataset;
- ``writes``  (:class:`~ppoflow.tasks.checkpoints.Writes`): the checkpoints being written in the
  background;
- ``lock``: the experiment lock the flow holds; ``producer``: with asynchronous training, the
  rollout producer the flow started and watches (None otherwise); and the routing of rank output
  into the log of the task currently using a group (:meth:`RunContext.using`; else the flow's logger).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.tasks.checkpoints import Writes
from ppoflow.tasks.run.groups import RunGroups
from ppoflow.tasks.run.inputs import RunInputs

__all__ = ["RunContext", "open_run", "get_run", "close_run", "abort_run", "worker_groups"]

_LOG = logging.getLogger("ppoflow.flow")


class RunContext:
    """Flow-run-scoped state shared by the tasks (see the module docstring)."""

    def __init__(self, key: str, cfg: ExperimentConfig, log: Any = None, roles: dict[str, str] | None = None):
        self.key, self.cfg = key, cfg
        self.paths = ExperimentPaths.of(cfg)
        self.log = log or _LOG
        self.lock: Any = None  # the ExperimentLock, set by the flow
        self.producer: Any = None  # the rollout producer the flow started (an object with check())
        self._sinks: dict[str, Any] = {}
        # a wait for a write also ends when this run loses its experiment lock
        self.writes = Writes(timeout_s=cfg.checkpoint.wait_timeout_s, check=self._check_lock)
        self.inputs = RunInputs(cfg)
        self.groups = RunGroups(key, cfg, self.paths, self.writes, self._emit, self.log, roles)

    def _check_lock(self) -> None:
        if self.lock is not None:
            self.lock.check()

    def check_producer(self) -> None:
        """While a task waits for the rollout queue: raise if this run lost its lock, and let the
        producer the flow started say whether it still runs (it is started again, or raises)."""
        self._check_lock()
        if self.producer is not None:
            self.producer.check()

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
    key: str, cfg: ExperimentConfig, log: Any = None, roles: dict[str, str] | None = None
) -> RunContext:
    """Create the context of flow run ``key`` (and set the storage options of its protocol);
    ``roles``: see :class:`~ppoflow.tasks.run.groups.RunGroups`."""
    if cfg.storage.storage_options:
        storage.set_default_storage_options(
            storage.protocol_of(cfg.storage.root), cfg.storage.storage_options
        )
    with _RUNS_LOCK:
        if key in _RUNS and not _RUNS[key].closed:
            raise RuntimeError(f"flow run {key} already has an open context")
        ctx = _RUNS[key] = RunContext(key, cfg, log, roles)
        return ctx


def get_run(key: str) -> RunContext:
    """The context of flow run ``key``; a clear error if the flow did not open it."""
    try:
        return _RUNS[key]
    except KeyError:
        raise RuntimeError(
            f"no open ppoflow run {key!r}: ppoflow tasks run inside the `ppo` flow, "
            f"which opens the run's worker groups"
        ) from None


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
