"""One flow run's hold on an experiment: :class:`ExperimentSession`, what the flows open first.

    with ExperimentSession(cfg, logger, key) as session:     # the ``ppo`` flow's
        manifest = session.manifest                           # None: a new experiment
        ...run_iterations(session.ctx, manifest, n, session.record)...
        session.plot_at_close(manifest)

Entering takes, in this order (each released in reverse, whatever ends the block):

0. with the preflight on, on GPUs: ``auto`` update token budgets become the largest the memory
   plan fits (``ppoflow.infra.preflight.memory_check.refine_auto_budgets``, logged), before any
   worker group exists;
1. the run's context (``ppoflow.tasks.run``: its worker groups, inputs, background writes);
2. the experiment lock (no two runs of one experiment overlap), then the manifest, whose identity
   (model, tokenizer, ...) is checked against the config: a changed experiment fails here;
3. the ``preflight`` task (data, models, reward function, storage, checkpoints);
4. this machine's device slots (``ppoflow.infra.remote.driver.slots``), then the span of the
   worker groups, inside the slots: the ranks free the devices before the slots are released, and
   on Ctrl-C or SIGTERM the groups are killed at once (``worker_groups``).

A reader of committed state (the ``ppo-eval`` flow) opens one with ``lock=False, preflight=False``:
device slots and worker groups only; the rollout producer of asynchronous training (``ppo-rollout``)
one more with ``slots=False`` when the trainer started it on the trainer's devices.

Leaving: the groups are shut down and the slots released first; then, still under the lock, a
failed run marks its tracked runs failed, and a run that trained draws the experiment's plot
(``plots/metrics.png``, a markdown artifact, an MLflow artifact) and marks its tracked runs finished.

:attr:`ExperimentSession.tracker` is where the run's records go beside the experiment's own: the
experiment's MLflow run when ``MLFLOW_TRACKING_URI`` is set (:mod:`ppoflow.infra.experiment.tracking`),
its W&B run when the config sets ``tracking.wandb`` (:mod:`ppoflow.infra.experiment.wandb_tracking`),
both at once (:class:`Trackers`), or a tracker that records nothing.
"""

from __future__ import annotations

import base64
import contextlib
import uuid
from types import TracebackType
from typing import Any, Protocol

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
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
from ppoflow.tasks.run import RunContext, open_run, worker_groups
from ppoflow.tasks.step import artifact_slug, with_retries

__all__ = ["ExperimentSession", "Tracker", "NoTracker", "Trackers", "flow_run_key"]


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


def flow_run_key() -> str:
    """The current Prefect flow run's id (a fresh id outside one): the key of its run context."""
    from prefect.runtime import flow_run

    return str(flow_run.get_id() or uuid.uuid4())


class ExperimentSession:
    """A flow run's lock, manifest, device slots, worker groups, tracker and plot (module
    docstring). ``roles``: the worker classes of the run's groups
    (:class:`~ppoflow.tasks.run.groups.RunGroups`); ``lock``: take the experiment lock and read
    the manifest; ``preflight``: run the ``preflight`` task before taking the device slots;
    ``slots``: take them (a rollout producer the trainer started runs on the trainer's)."""

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
    ):
        self.cfg, self.logger, self.key = cfg, logger, key
        self.paths = ExperimentPaths.of(cfg)
        self.roles, self.locking, self.preflight, self.slots = roles, lock, preflight, slots
        self.manifest: Manifest | None = None  # the committed state when the session opened
        self._tracker: Tracker | None = None
        self._plot: Manifest | None = None
        self._stack: contextlib.ExitStack | None = None
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

    def __enter__(self) -> ExperimentSession:
        if self.preflight:
            refine_auto_budgets(self.cfg, self.logger.info)
        with contextlib.ExitStack() as stack:  # a failure part-way releases what was taken
            self._ctx = open_run(self.key, self.cfg, log=self.logger, roles=self.roles)
            stack.enter_context(worker_groups(self.key))  # covers failures before the slots are taken
            if self.locking:
                self._ctx.lock = stack.enter_context(
                    ExperimentLock(self.paths.lock, run_id=self.key, log=self.logger.warning)
                )
                self.manifest = self._read_manifest()
            stack.push(self._close)  # runs after the slots are released, before the lock is
            if self.preflight:
                with_retries(preflight_task, self.cfg.resources.task_retries)(self.key)
            if self.slots:
                stack.enter_context(
                    device_slots(self.cfg, self.logger.info, run_id=self.key, wait_log=self.logger.warning)
                )
            stack.enter_context(worker_groups(self.key))  # the ranks free the devices before the slots
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None, "the session was not entered"
        return stack.__exit__(kind, exc, tb)

    def _read_manifest(self) -> Manifest | None:
        manifest = read_manifest(self.paths)
        if manifest is not None:
            check_identity(manifest, self.cfg)
            self.logger.info(
                f"experiment {self.cfg.storage.experiment!r}: continuing after iteration "
                f"{manifest.iteration} ({self.paths.manifest})"
            )
        return manifest

    def _close(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
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
