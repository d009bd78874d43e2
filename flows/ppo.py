"""The ``ppo`` flow: PPO iterations of one experiment, one Prefect task per step.

    from ppoflow.flows.ppo import ppo
    ppo(load_config("experiment.yaml"), iterations=20)      # or ppo("experiment.yaml", 20)

A run continues the experiment from its last committed iteration (``manifest.json``; a new
experiment is initialised first) and runs ``iterations`` more. Each iteration is this graph of
tasks (their order, pipelined commits and the one-step overlap are in :mod:`ppoflow.flows.schedule`)::

    generate ──► ref_log_prob ─┐
       │    ├──► values ───────┼──► advantage ──► update_actor ──┐
       │    └──► rm_score ─────┘                  update_critic ─┴──► commit

(``ref_log_prob`` runs when a KL term needs it, ``values`` with a critic, ``rm_score`` with a
reward model; the tasks of one row run concurrently on their own worker groups.) Tasks exchange
URLs and small JSON receipts; data lives under ``<root>/<experiment>/iterations/{n:06d}/``.
Checkpoints are written in the background: ``commit n`` waits for them while iteration n+1 runs.

Around the iterations: the experiment lock (no two runs of one experiment overlap), the
``preflight`` task (data, models, reward function, storage and checkpoints checked before anything
starts), the machine's device slots (``ppoflow.infra.remote.driver.slots``: file locks that free themselves when
their holder dies), and the run's worker groups, started when first needed, kept across the
iterations, shut down at the end; on Ctrl-C or SIGTERM killed at once.

Resume: every task returns its stored result when its outputs already exist, so retrying a failed
flow run (``prefect flow-run retry``, the UI's button) or running the flow again resumes at the
first unfinished task, with the same committed result as a run that never failed.

The UI shows per iteration a table artifact of the metrics and a markdown trend summary, a
progress artifact during generation, the ranks' output in each task's logs, and at the end of the
run a plot of the experiment's metrics. With ``MLFLOW_TRACKING_URI`` set, the config, each
iteration's metrics and evaluation files and the plot go to the experiment's MLflow run too
(:mod:`ppoflow.infra.experiment.tracking`).
"""

from __future__ import annotations

import base64
import dataclasses
import sys
import uuid
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from ppoflow.flows.schedule import needs_reference, pending_roles, run_iterations
from ppoflow.flows.signals import Terminated, install_stop_handlers
from ppoflow.infra.config import ConfigError, ExperimentConfig, load_config, parse_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.evaluation import EVAL_DIR, VAL_TAG
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest, check_identity, read_manifest
from ppoflow.infra.experiment.metrics import headline_line, metrics_table, trend_markdown
from ppoflow.infra.experiment.plots import plot_metrics
from ppoflow.infra.experiment.tracking import MlflowTracker
from ppoflow.infra.remote.driver.slots import device_slots
from ppoflow.tasks import evaluate, init_experiment, preflight
from ppoflow.tasks.run import RunContext, open_run, worker_groups
from ppoflow.tasks.step import artifact_slug

__all__ = ["ppo", "resolve_config", "install_stop_handlers", "Terminated", "needs_reference"]


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


def _publish_iteration(ctx: RunContext, manifest: Manifest, metrics: dict[str, Any]) -> None:
    slug = artifact_slug(ctx.cfg.storage.experiment)
    n = manifest.iteration
    create_table_artifact(
        metrics_table(metrics),
        key=f"{slug}-metrics",
        description=f"ppo iteration {n} of {ctx.cfg.storage.experiment}",
    )
    create_markdown_artifact(
        trend_markdown(ctx.cfg.storage.experiment, manifest.trend),
        key=f"{slug}-summary",
        description=f"trend after iteration {n}",
    )
    get_run_logger().info(headline_line(n, metrics))


def _track_iteration(
    ctx: RunContext, tracker: MlflowTracker | None, manifest: Manifest, metrics: dict[str, Any]
) -> None:
    """The iteration's metrics (and its held-out evaluation's files) to MLflow, when tracking."""
    if tracker is not None:
        n = manifest.iteration
        evaluated = any(k.startswith("val/") for k in metrics)
        tracker.log_iteration(n, metrics, ctx.paths.file(n, f"{EVAL_DIR}/{VAL_TAG}") if evaluated else None)


def _publish_plot(ctx: RunContext, manifest: Manifest) -> str | None:
    """Plot the experiment's trend (kept in the manifest) to ``plots/metrics.png`` and attach it
    as a markdown artifact with the PNG inline (the UI's image artifacts need a public URL)."""
    if not manifest.trend:
        return None
    url = plot_metrics(
        manifest.trend,
        storage.join(ctx.paths.root, "plots", "metrics.png"),
        title=f"{ctx.cfg.storage.experiment}: iterations 1-{manifest.iteration}",
    )
    png = base64.b64encode(storage.read_bytes(url)).decode()
    create_markdown_artifact(
        f"# {ctx.cfg.storage.experiment}: metrics after iteration {manifest.iteration}\n\n"
        f"![metrics](data:image/png;base64,{png})\n\n`{url}`",
        key=f"{artifact_slug(ctx.cfg.storage.experiment)}-plot",
        description="metrics plot",
    )
    return url


def _log_stream(logger: Any, stream: Any) -> None:
    joined = [r for r in stream.records if r["joined"] == stream.after + 1]
    rows = sum(int(r["rows"]) for r in stream.records)
    line = f"data: {len(stream.records)} file(s), {rows} rows"
    if joined and stream.fresh is not None:
        line += f"; new since iteration {stream.after}: " + ", ".join(
            f"{r['url']} ({r['rows']} rows)" for r in joined
        )
        line += " (visited first in a new epoch)"
    logger.info(line)


def _run_key() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.get_id() or uuid.uuid4())


@flow(name="ppo", log_prints=False)
def ppo(config: ExperimentConfig | str, iterations: int = 1) -> dict[str, Any]:
    """Run ``iterations`` PPO iterations of the experiment ``config`` describes.

    Args:
        config: the experiment config (a form in the UI), or a YAML path / fsspec URL.
        iterations: how many iterations to add to the experiment in this run.

    Returns:
        ``{experiment, iteration, manifest, metrics}``: the last committed iteration, the manifest
        URL and that iteration's metrics.
    """
    cfg = resolve_config(config)
    if iterations < 0:
        raise ConfigError(f"iterations={iterations} must be >= 0")
    logger = get_run_logger()
    key = _run_key()
    paths = ExperimentPaths.of(cfg)
    ctx = open_run(key, cfg, log=logger)
    metrics: dict[str, Any] = {}
    with worker_groups(key):  # covers failures before the slots were taken
        with ExperimentLock(paths.lock, run_id=key, log=logger.warning) as lock:
            ctx.lock = lock
            manifest = read_manifest(paths)
            if manifest is not None:
                check_identity(manifest, cfg)
                logger.info(
                    f"experiment {cfg.storage.experiment!r}: continuing after iteration "
                    f"{manifest.iteration} ({paths.manifest})"
                )
            preflight(key)
            with device_slots(cfg, logger.info, run_id=key, wait_log=logger.warning):
                with worker_groups(key):  # the ranks free the devices before the slots are released
                    if manifest is None:
                        ctx.groups.prestart(
                            pending_roles(ctx, 1)
                            if iterations
                            else ["actor"] + (["critic"] if cfg.critic.enable else [])
                        )
                        manifest = init_experiment(key)
                    if iterations:
                        stream = ctx.inputs.open_stream(paths.root, key, manifest)
                        cursor = stream.start_cursor(manifest.data_cursor, manifest.iteration)
                        manifest = dataclasses.replace(manifest, data_cursor=cursor)
                        _log_stream(logger, stream)
                    if manifest.iteration == 0 and cfg.data.val_files and cfg.evaluation.before_training:
                        # the base policy's held-out score, on the actor group that saved it
                        evaluate(key, 0, paths.url(manifest.actor_checkpoint))
                    tracker = MlflowTracker.of(paths.root, cfg.storage.experiment, logger.warning)
                    if tracker is not None:
                        tracker.start(cfg.model_dump(mode="json"))

                    def on_commit(m: Manifest, x: dict[str, Any]) -> None:
                        _publish_iteration(ctx, m, x)
                        _track_iteration(ctx, tracker, m, x)

                    try:
                        manifest, metrics = run_iterations(ctx, manifest, iterations, on_commit)
                    except BaseException:
                        if tracker is not None:
                            tracker.finish(ok=False)
                        raise
            if iterations:
                plot = _publish_plot(ctx, manifest)
                if tracker is not None and plot is not None:
                    tracker.log_file(plot, "plots")
            if tracker is not None:
                tracker.finish()
    return {
        "experiment": cfg.storage.experiment,
        "iteration": manifest.iteration,
        "manifest": paths.manifest,
        "metrics": metrics,
    }


if __name__ == "__main__":
    install_stop_handlers()
    ppo(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
