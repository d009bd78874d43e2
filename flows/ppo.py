"""The ``ppo`` flow: PPO iterations of one experiment, one Prefect task per step.

    from ppoflow.flows.ppo import ppo
    ppo(load_config("experiment.yaml"), iterations=20)      # or ppo("experiment.yaml", 20)

A run continues the experiment from its last committed iteration (``manifest.json``; a new
experiment is initialised first) and runs ``iterations`` more. Each iteration runs the steps of
the table :data:`ppoflow.tasks.graph.STEPS` that the config turns on (their order, pipelined
commits and the one-step overlap are in :mod:`ppoflow.flows.schedule`; the picture is in
docs/internals.md); steps of one stage run concurrently on their own worker groups. Tasks exchange
URLs and small JSON receipts; data lives under ``<root>/<experiment>/iterations/{n:06d}/``.
Checkpoints are written in the background: ``commit n`` waits for them while iteration n+1 runs.

Around the iterations, the run's :class:`~ppoflow.flows.session.ExperimentSession`: the experiment
lock (no two runs of one experiment overlap), the manifest, the ``preflight`` task (data, models,
reward function, storage and checkpoints checked before anything starts), the machine's device
slots (file locks that free themselves when their holder dies), and the run's worker groups,
started when first needed, kept across the iterations, shut down at the end; on Ctrl-C or SIGTERM
killed at once.

With ``asynchronous.enable`` the iteration takes its rollout from the experiment's queue, which the
``ppo-rollout`` flow fills ahead of it within ``asynchronous.max_staleness``: the run's rollout
source, picked once here and held by the session (:mod:`ppoflow.flows.asynchronous`; docs/async.md).

Resume: every task returns its stored result when its outputs already exist, so retrying a failed
flow run (``prefect flow-run retry``, the UI's button) or running the flow again resumes at the
first unfinished task, with the same committed result as a run that never failed.

The UI shows per iteration a table artifact of the metrics and a markdown trend summary, a
progress artifact during generation, the ranks' output in each task's logs, and at the end of the
run a plot of the experiment's metrics. With ``MLFLOW_TRACKING_URI`` set, the config, each
iteration's metrics and evaluation files and the plot go to the experiment's MLflow run too
(:mod:`ppoflow.infra.experiment.tracking`); with ``tracking.wandb`` in the config, the config,
metrics and sample tables to its W&B run (:mod:`ppoflow.infra.experiment.wandb_tracking`).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from prefect import flow, get_run_logger

from ppoflow.flows.asynchronous import rollout_source
from ppoflow.flows.schedule import pending_roles, run_iterations
from ppoflow.flows.session import ExperimentSession, flow_run_key, resolve_config
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.experiment.manifest import Manifest
from ppoflow.tasks import evaluate, init_experiment
from ppoflow.tasks.graph import actor_group_role, trained_roles
from ppoflow.tasks.step import with_retries

__all__ = ["ppo", "resolve_config"]


def _initialise(session: ExperimentSession, iterations: int) -> Manifest:
    """A new experiment's iteration 0, on the groups its first iteration needs (started together)."""
    cfg = session.cfg
    session.ctx.groups.prestart(pending_roles(session.ctx, 1) if iterations else trained_roles(cfg))
    return with_retries(init_experiment, session.cfg.resources.task_retries)(session.key)


def _open_stream(session: ExperimentSession, manifest: Manifest) -> Manifest:
    """Open the training data (files that arrived since the last run join it) at the manifest's
    cursor, and say what it holds."""
    stream = session.ctx.inputs.open_stream(session.paths.root, session.key, manifest)
    cursor = stream.start_cursor(manifest.data_cursor, manifest.iteration)
    joined = [r for r in stream.records if r["joined"] == stream.after + 1]
    rows = sum(int(r["rows"]) for r in stream.records)
    line = f"data: {len(stream.records)} file(s), {rows} rows"
    if joined and stream.fresh is not None:
        line += f"; new since iteration {stream.after}: " + ", ".join(
            f"{r['url']} ({r['rows']} rows)" for r in joined
        )
        line += " (visited first in a new epoch)"
    session.logger.info(line)
    return dataclasses.replace(manifest, data_cursor=cursor)


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
    metrics: dict[str, Any] = {}
    logger = get_run_logger()
    with ExperimentSession(
        cfg,
        logger,
        flow_run_key(),
        roles={"actor": actor_group_role(cfg)},
        rollouts=rollout_source(cfg, iterations, logger.info),  # the queue's producer starts as it opens
    ) as session:
        manifest = session.manifest if session.manifest is not None else _initialise(session, iterations)
        if iterations:
            manifest = _open_stream(session, manifest)
        if manifest.iteration == 0 and cfg.data.val_files and cfg.evaluation.before_training:
            # the base policy's held-out score, on the actor group that saved it
            base = session.paths.url(manifest.actor_checkpoint)
            with_retries(evaluate, cfg.resources.task_retries)(session.key, 0, actor=base)
        session.tracker.start(cfg.model_dump(mode="json"))
        manifest, metrics = run_iterations(session.ctx, manifest, iterations, session.record)
        if iterations:
            session.plot_at_close(manifest)
    return {
        "experiment": cfg.storage.experiment,
        "iteration": manifest.iteration,
        "manifest": session.paths.manifest,
        "metrics": metrics,
    }


if __name__ == "__main__":
    from ppoflow.infra.runtime.signals import install_stop_handlers

    install_stop_handlers()
    ppo(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
