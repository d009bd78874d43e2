"""One flow run's hold on an experiment: :class:`ExperimentSession`, what the flows open first.

    with ExperimentSession(cfg, logger, key) as session:     # the ``ppo`` flow's
        manifest = session.manifest                           # None: a new experiment
        ...run_iterations(session.ctx, manifest, n, session.record)...
        session.plot_at_close(manifest)

Entering takes, in this order (each only if it is for this session; whatever ends the block,
what was taken is given back in the order of :data:`TEARDOWN`):

0. with the preflight on, on GPUs: ``auto`` update token budgets become the largest the memory
   plan fits (``ppoflow.infra.preflight.memory_check.refine_auto_budgets``, logged), before any
   worker group exists;
1. the run's storage (:class:`~ppoflow.infra.data.storage.RunStorage`: its storage options, the
   root protocol's defaults while the run is open);
2. the experiment lock (no two runs of one experiment overlap), then the manifest, whose identity
   (model, tokenizer, ...) is checked against the config: a changed experiment fails here;
3. the run's context (``ppoflow.tasks.run``: its worker groups, inputs, background writes), made
   here and only here, with what it is given: the lock, the storage, the rollout source. It is
   fixed from then on, and lives in this process: the run's tasks run here (``get_run``);
4. the ``preflight`` task (data, models, reward function, storage, checkpoints);
5. this machine's device slots (``ppoflow.infra.remote.driver.slots``); the worker groups start
   inside them when first needed;
6. the rollout source's start (:class:`~ppoflow.tasks.run.rollouts.RolloutSource`; the ``ppo``
   flow passes asynchronous training's queue, ``ppoflow.flows.asynchronous``, whose producer
   starts now, on the trainer's devices).

Leaving (:data:`TEARDOWN`): the rollout source stops (its producer at once when the run failed);
the groups are shut down (killed at once on Ctrl-C or SIGTERM) and the run forgotten; the slots
are released; then, still under the lock, a failed run marks its tracked runs failed, and a run
that trained draws the experiment's plot (``plots/metrics.png``, a markdown artifact, an MLflow
artifact) and marks its tracked runs finished; the lock is released; the storage options go.

A reader of committed state (the ``ppo-eval`` flow) opens one with ``lock=False, preflight=False``:
device slots and worker groups only; the rollout producer of asynchronous training (``ppo-rollout``)
one more with ``slots=False`` when the trainer started it on the trainer's devices.

:attr:`ExperimentSession.tracker` is where the run's records go beside the experiment's own: the
experiment's MLflow run when ``MLFLOW_TRACKING_URI`` is set (:mod:`ppoflow.infra.experiment.tracking`),
its W&B run when the config sets ``tracking.wandb`` (:mod:`ppoflow.infra.experiment.wandb_tracking`),
both at once (:class:`Trackers`), or a tracker that records nothing.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from ppoflow.infra.config import ConfigError, ExperimentConfig, load_config, parse_config
from ppoflow.infra.data import storage
from ppoflow.infra.data.storage import RunStorage
from ppoflow.infra.experiment.evaluation import EVAL_DIR, VAL_TAG
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest, check_identity, read_manifest
from ppoflow.infra.experiment.metrics import headline_line, metrics_table, trend_markdown
from ppoflow.infra.experiment.plots import plot_metrics
from ppoflow.infra.experiment.tracking import MlflowTracker
from ppoflow.infra.experiment.wandb_tracking import WandbTracker
from ppoflow.infra.preflight.memory_check import refine_auto_budgets
from ppoflow.infra.remote.driver.slots import device_slots
from ppoflow.tasks import preflight as preflight_task
from ppoflow.tasks.run import SYNCHRONOUS, RolloutSource, RunContext, abort_run, close_run, open_run
from ppoflow.tasks.step import artifact_slug, with_retries

__all__ = [
    "ExperimentSession",
    "Tracker",
    "NoTracker",
    "Trackers",
    "flow_run_key",
    "resolve_config",
    "TEARDOWN",
]

#: What a session gives back as it closes, in this order (each step only if it was taken): the
#: rollout source's producer ends before the groups whose devices it shares; the ranks free the
#: devices before the slots are released; the tracker and the plot are done before the lock goes
#: (no other run writes the experiment meanwhile); the storage options last.
TEARDOWN = ("rollouts", "groups", "slots", "records", "lock", "storage")

_Step = Callable[[BaseException | None], None]


class Tracker(Protocol):
    """What the flows record to an experiment tracker (:class:`MlflowTracker`'s and
    :class:`WandbTracker`'s methods)."""

    def start(self, config: dict[str, Any]) -> None: ...
    def log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None = None) -> None: ...
    def log_file(self, url: str, artifact_path: str | None = None) -> None: ...
    def finish(self, ok: bool = True) -> None: ...


class NoTracker:
    """The tracker when tracking is off: records nothing."""

    def start(self, config: dict[str, Any]) -> None:
        pass

    def log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None = None) -> None:
        pass

    def log_file(self, url: str, artifact_path: str | None = None) -> None:
        pass

    def finish(self, ok: bool = True) -> None:
        pass


class Trackers:
    """Several trackers at once (MLflow and W&B): each call goes to every one, in order (each
    swallows its own failures)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def start(self, config: dict[str, Any]) -> None:
        for t in self.trackers:
            t.start(config)

    def log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None = None) -> None:
        for t in self.trackers:
            t.log_iteration(n, metrics, eval_dir)

    def log_file(self, url: str, artifact_path: str | None = None) -> None:
        for t in self.trackers:
            t.log_file(url, artifact_path)

    def finish(self, ok: bool = True) -> None:
        for t in self.trackers:
            t.finish(ok)


def resolve_config(config: ExperimentConfig | str | dict) -> ExperimentConfig:
    """The config given to the flow: a model, a YAML path/URL, or a dict (deployment JSON)."""
    if isinstance(config, ExperimentConfig):
        return config
    if isinstance(config, str):
        return load_config(config)
    if isinstance(config, dict):
        return parse_config(config, source="flow parameter 'config'")
    raise ConfigError(
        f"config must be an ExperimentConfig, a YAML path/URL or a dict; got {type(config).__name__}"
    )


def flow_run_key() -> str:
    """The current Prefect flow run's id (a fresh id outside one): the key of its run context."""
    from prefect.runtime import flow_run

    return str(flow_run.get_id() or uuid.uuid4())


class ExperimentSession:
    """A flow run's storage, lock, manifest, context, device slots, rollout source, tracker and
    plot (module docstring). ``roles``: the worker classes of the run's groups
    (:class:`~ppoflow.tasks.run.groups.RunGroups`); ``lock``: take the experiment lock and read
    the manifest; ``preflight``: run the ``preflight`` task before taking the device slots;
    ``slots``: take them (a rollout producer the trainer started runs on the trainer's);
    ``rollouts``: where the run's rollouts come from (the synchronous ``generate`` unless the
    ``ppo`` flow passes asynchronous training's queue)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        logger: Any,
        key: str,
        *,
        roles: dict[str, str] | None = None,
        lock: bool = True,
        preflight: bool = True,
        slots: bool = True,
        rollouts: RolloutSource = SYNCHRONOUS,
    ):
        self.cfg, self.logger, self.key = cfg, logger, key
        self.paths = ExperimentPaths.of(cfg)
        self.roles, self.locking, self.preflight, self.slots = roles, lock, preflight, slots
        self.rollouts = rollouts
        self.manifest: Manifest | None = None  # the committed state when the session opened
        self._tracker: Tracker | None = None
        self._plot: Manifest | None = None
        self._taken: dict[str, _Step] = {}  # what __exit__ gives back, by TEARDOWN's names
        self._ctx: RunContext | None = None

    @property
    def ctx(self) -> RunContext:
        """The run's context, which the tasks look up by :attr:`key`."""
        if self._ctx is None:
            raise RuntimeError("the session is not open: use it as `with ExperimentSession(...) as session:`")
        return self._ctx

    @property
    def tracker(self) -> Tracker:
        """The experiment's MLflow and W&B runs, either, or :class:`NoTracker` (tracking off)."""
        if self._tracker is None:
            warn = self.logger.warning
            found: list[Tracker] = [
                t
                for t in (
                    MlflowTracker.of(self.paths.root, self.cfg.storage.experiment, warn),
                    WandbTracker.of(self.cfg, self.paths.root, warn),
                )
                if t is not None
            ]
            self._tracker = Trackers(found) if len(found) > 1 else found[0] if found else NoTracker()
        return self._tracker

    # -- opening and closing -------------------------------------------------------------------

    def _took(self, name: str, give_back: _Step) -> None:
        assert name in TEARDOWN and name not in self._taken, name
        self._taken[name] = give_back

    def __enter__(self) -> ExperimentSession:
        if self._taken or self._ctx is not None:
            raise RuntimeError("a session opens once: make a new ExperimentSession for another run")
        if self.preflight:
            refine_auto_budgets(self.cfg, self.logger.info)
        try:
            self._open()
        except BaseException as exc:  # a failure part-way gives back what was taken
            self._give_back(exc)
            raise
        return self

    def _open(self) -> None:
        """Take what the session holds, in the module docstring's order."""
        run_storage = RunStorage(self.cfg.storage.root, self.cfg.storage.storage_options).open()
        self._took("storage", lambda exc: run_storage.close())
        lease: ExperimentLock | None = None
        if self.locking:
            held_lock = ExperimentLock(self.paths.lock, run_id=self.key, log=self.logger.warning).acquire()
            self._took("lock", lambda exc: held_lock.release())
            lease = held_lock
            self.manifest = self._read_manifest()
        self._ctx = open_run(
            self.key,
            self.cfg,
            log=self.logger,
            roles=self.roles,
            lock=lease,
            rollouts=self.rollouts,
            storage=run_storage,
        )
        self._took("groups", self._close_groups)
        self._took("records", self._close)
        if self.preflight:
            with_retries(preflight_task, self.cfg.resources.task_retries)(self.key)
        if self.slots:
            held = device_slots(self.cfg, self.logger.info, run_id=self.key, wait_log=self.logger.warning)
            held.__enter__()

            def release_slots(exc: BaseException | None) -> None:
                held.__exit__(type(exc) if exc else None, exc, None)

            self._took("slots", release_slots)
        self._took("rollouts", lambda exc: self.rollouts.stop(failed=exc is not None))  # a part-way start too
        self.rollouts.start(self.manifest.iteration if self.manifest is not None else 0)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._taken:
            raise RuntimeError("the session was not entered")
        error = self._give_back(exc)
        if error is not None and exc is None:
            raise error

    def _give_back(self, exc: BaseException | None) -> BaseException | None:
        """Run the steps taken, in :data:`TEARDOWN`'s order, each whatever the others did; the first
        step's error (logged when the block's own error is the one raised)."""
        taken, self._taken = self._taken, {}
        first: BaseException | None = None
        for name in TEARDOWN:
            if name not in taken:
                continue
            try:
                taken[name](exc)
            except BaseException as err:  # noqa: BLE001 - the other steps still run
                first = first or err
                if exc is not None or first is not err:
                    self.logger.warning(f"closing the session: {name} failed too: {err!r}")
        return first

    def _close_groups(self, exc: BaseException | None) -> None:
        """Shut the run's groups down and forget the run; on an interrupt (Ctrl-C, SIGTERM: a
        ``BaseException`` that is not an ``Exception``) kill them first, so no rank delays the exit."""
        if exc is not None and not isinstance(exc, Exception):
            abort_run(self.key)
        close_run(self.key)

    def _read_manifest(self) -> Manifest | None:
        manifest = read_manifest(self.paths)
        if manifest is not None:
            check_identity(manifest, self.cfg)
            self.logger.info(
                f"experiment {self.cfg.storage.experiment!r}: continuing after iteration "
                f"{manifest.iteration} ({self.paths.manifest})"
            )
        return manifest

    def _close(self, exc: BaseException | None) -> None:
        """The tracker and the plot, once the groups are down and the slots free (module docstring)."""
        if exc is not None:
            if self._tracker is not None:
                self._tracker.finish(ok=False)
            return
        if self._plot is not None:
            plot = self._publish_plot(self._plot)
            if plot is not None:
                self.tracker.log_file(plot, "plots")
        if self._tracker is not None:
            self._tracker.finish()

    # -- what the run records ------------------------------------------------------------------

    def record(self, manifest: Manifest, metrics: dict[str, Any]) -> None:
        """A committed iteration: its metrics table and the trend as Prefect artifacts, its
        headline in the log, its metrics (and held-out evaluation's files) to the tracker."""
        slug = artifact_slug(self.cfg.storage.experiment)
        n = manifest.iteration
        create_table_artifact(
            metrics_table(metrics),
            key=f"{slug}-metrics",
            description=f"ppo iteration {n} of {self.cfg.storage.experiment}",
        )
        create_markdown_artifact(
            trend_markdown(self.cfg.storage.experiment, manifest.trend),
            key=f"{slug}-summary",
            description=f"trend after iteration {n}",
        )
        self.logger.info(headline_line(n, metrics))
        evaluated = any(k.startswith("val/") for k in metrics)
        eval_dir = self.paths.file(n, f"{EVAL_DIR}/{VAL_TAG}") if evaluated else None
        self.tracker.log_iteration(n, metrics, eval_dir)

    def plot_at_close(self, manifest: Manifest) -> None:
        """Draw the experiment's trend as of ``manifest`` when the session closes without error."""
        self._plot = manifest

    def _publish_plot(self, manifest: Manifest) -> str | None:
        """Plot the trend (kept in the manifest) to ``plots/metrics.png`` and attach it as a
        markdown artifact with the PNG inline (the UI's image artifacts need a public URL)."""
        if not manifest.trend:
            return None
        experiment = self.cfg.storage.experiment
        url = plot_metrics(
            manifest.trend,
            storage.join(self.paths.root, "plots", "metrics.png"),
            title=f"{experiment}: iterations 1-{manifest.iteration}",
        )
        png = base64.b64encode(storage.read_bytes(url)).decode()
        create_markdown_artifact(
            f"# {experiment}: metrics after iteration {manifest.iteration}\n\n"
            f"![metrics](data:image/png;base64,{png})\n\n`{url}`",
            key=f"{artifact_slug(experiment)}-plot",
            description="metrics plot",
        )
        return url
