"""Entrypoints of the ``ppo/iteration`` and ``ppo-eval/evaluate`` deployments (``prefect.yaml``).

``iteration`` *is* the ``ppo`` flow — same name, same body (it calls ``ppo.fn``, so a run is one
flow run holding the iteration's tasks, not a parent run with a child) — with one addition: the
``config`` parameter may be left empty. An empty ``config`` runs the embedded default, the demo's
tiny CPU experiment on local files under ``demo_storage`` (``runs/demo``, relative to the
deployment's working directory, the checkout ``prefect deploy`` ran in). A run that finds no
default experiment there builds it first — tiny model and tokenizer, prompts, the format warm
start, ``config.yaml`` — with the demo's own builder (``ppoflow.demo.experiment.prepare``), so ``prefect deployment run ppo/iteration`` works on a fresh machine without
``ppoflow demo`` ever having run, and continues the same experiment ``ppoflow demo`` trains.

    prefect deployment run ppo/iteration                              # the embedded default
    prefect deployment run ppo/iteration -p iterations=20
    prefect deployment run ppo/iteration -p config=experiments/my.yaml  # any experiment

``evaluation`` is the ``ppo-eval`` flow (``ppoflow.flows.evaluate``) with the same default:

    prefect deployment run ppo-eval/evaluate                          # the demo's latest iteration
    prefect deployment run ppo-eval/evaluate -p iteration=10 -p config=experiments/my.yaml
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prefect import flow, get_run_logger

from ppoflow.flows.evaluate import evaluate
from ppoflow.flows.ppo import ppo, resolve_config
from ppoflow.infra.config import ExperimentConfig

__all__ = ["iteration", "evaluation", "default_config", "config_or_default", "DEFAULT_DEMO_STORAGE"]

#: Where the embedded default experiment lives, relative to the working directory.
DEFAULT_DEMO_STORAGE = "runs/demo"


def default_config(
    demo_storage: str = DEFAULT_DEMO_STORAGE, log: Callable[[str], None] | None = None
) -> ExperimentConfig:
    """The embedded default experiment under ``demo_storage``: the demo's ``config.yaml`` there,
    after building whatever of the demo is missing (``ppoflow.demo.experiment.prepare``; ``log`` gets its
    progress lines)."""
    from ppoflow.demo.experiment import prepare

    return prepare(demo_storage, log=log)


def config_or_default(config: ExperimentConfig | str | None, demo_storage: str) -> ExperimentConfig:
    """A deployment's ``config`` parameter resolved; empty: the embedded default experiment under
    ``demo_storage`` (:func:`default_config`), said in the flow run's log."""
    if config is not None and config != "":
        return resolve_config(config)
    logger = get_run_logger()
    logger.info(f"no config given: the embedded default experiment in {os.path.abspath(demo_storage)}")
    return default_config(demo_storage, log=logger.info)


@flow(
    name=ppo.name,
    log_prints=ppo.log_prints,
    timeout_seconds=ppo.timeout_seconds,
    retries=ppo.retries,
    retry_delay_seconds=ppo.retry_delay_seconds,
)
def iteration(
    config: ExperimentConfig | str | None = None,
    iterations: int = 1,
    demo_storage: str = DEFAULT_DEMO_STORAGE,
) -> dict[str, Any]:
    """Run ``iterations`` PPO iterations of an experiment (the ``ppo`` flow).

    Args:
        config: the experiment config, or a YAML path / fsspec URL; empty runs the embedded
            default (the demo's tiny CPU experiment under ``demo_storage``).
        iterations: how many iterations to add to the experiment in this run.
        demo_storage: the embedded default's local directory (built there on first use);
            unused when ``config`` is given.

    Returns:
        ``{experiment, iteration, manifest, metrics}`` as the ``ppo`` flow returns them.
    """
    return ppo.fn(config_or_default(config, demo_storage), iterations)


@flow(name=evaluate.name, log_prints=evaluate.log_prints)
def evaluation(
    config: ExperimentConfig | str | None = None,
    iteration: int | None = None,
    files: list[str] | None = None,
    model: str | None = None,
    demo_storage: str = DEFAULT_DEMO_STORAGE,
) -> dict[str, Any]:
    """Evaluate a committed iteration of an experiment (the ``ppo-eval`` flow).

    Args:
        config: the experiment config, or a YAML path / fsspec URL; empty: the embedded default
            (the demo's experiment under ``demo_storage``).
        iteration: the committed iteration (default: the latest).
        files: held-out parquet files (default: the config's ``data.val_files``).
        model: a Hugging Face model directory to evaluate instead of a checkpoint.
        demo_storage: the embedded default's local directory; unused when ``config`` is given.

    Returns:
        ``{iteration, tag, out_dir, metrics, resumed}`` as the ``ppo-eval`` flow returns them.
    """
    return evaluate.fn(config_or_default(config, demo_storage), iteration, files, model)
