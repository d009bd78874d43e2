"""The ``ppo-eval`` flow: evaluate a committed iteration of an experiment, or a Hugging Face model
directory, on held-out prompts; the result is kept beside the iteration.

    from ppoflow.flows.evaluate import evaluate
    evaluate("experiment.yaml")                          # the latest committed iteration, data.val_files
    evaluate("experiment.yaml", iteration=12, files=["s3://bucket/test.parquet"])
    evaluate("experiment.yaml", model="/models/my-hf-dir")   # any HF directory, with the config's settings

The flow starts one worker group of its own (the policy and its rollout engine: no optimizer, no
reference), loads the iteration's actor checkpoint into it (or rebuilds the state from the
latest snapshot when the iteration is not one: the group then has the optimizer too), and runs the same generation and
scoring as training's ``evaluate`` task (``ppoflow.tasks.evaluate``): for ``data.val_files`` the
same responses and scores. It takes the machine's device slots but not the experiment lock: it
reads committed checkpoints and writes only under ``iterations/<n>/eval/<files>/`` (a model
directory's evaluation under ``<experiment>/evaluations/<model>/<files>/``), so it may run while
training goes on.
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any

from prefect import flow, get_run_logger

from ppoflow.flows.ppo import resolve_config
from ppoflow.flows.session import ExperimentSession
from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.evaluation import EVAL_DIR, eval_tag
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.experiment.metrics import evaluation_line
from ppoflow.tasks.evaluate import evaluate_checkpoint
from ppoflow.tasks.step import with_retries

__all__ = ["evaluate", "target_of"]


def target_of(
    cfg: ExperimentConfig, iteration: int | None, files: list[str], model: str | None
) -> tuple[ExperimentConfig, str | None, str, str, int | None]:
    """What to evaluate: ``(config, actor checkpoint or None, out_dir, tag, iteration)``; a
    :class:`ConfigError` naming what is missing."""
    paths = ExperimentPaths.of(cfg)
    tag = eval_tag(files, cfg.data.val_files)
    if model is not None:
        if iteration is not None:
            raise ConfigError("give either a model directory or an iteration to evaluate, not both")
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(model.rstrip("/"))) or "model"
        out_dir = storage.join(paths.root, "evaluations", slug, tag)
        mcfg = cfg.model.model_copy(update={"path": model, "tokenizer_path": None})
        return cfg.model_copy(update={"model": mcfg}), None, out_dir, tag, None
    manifest = read_manifest(paths)
    if manifest is None:
        raise ConfigError(
            f"no experiment at {paths.root}: nothing committed to evaluate (or give a model directory)"
        )
    n = manifest.iteration if iteration is None else iteration
    if n > manifest.iteration or n < 0:
        raise ConfigError(
            f"iteration {n} is not committed: the experiment's last committed iteration is {manifest.iteration}"
        )
    record = (
        manifest.to_json() if n == manifest.iteration else storage.read_json(paths.file(n, "manifest.json"))
    )
    checkpoint = paths.url(record["actor_checkpoint"])
    if checkpoint is None or not is_complete(checkpoint):
        raise ConfigError(
            f"the actor checkpoint of iteration {n} ({checkpoint}) is not complete on storage (retention may "
            "have removed it, or kept its weights only: checkpoint.keep_last / keep_every)"
        )
    return cfg, checkpoint, paths.file(n, f"{EVAL_DIR}/{tag}"), tag, n


@flow(name="ppo-eval", log_prints=False)
def evaluate(
    config: ExperimentConfig | str,
    iteration: int | None = None,
    files: list[str] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Evaluate a committed iteration (default: the latest) or a model directory.

    Args:
        config: the experiment config (a form in the UI), or a YAML path / fsspec URL.
        iteration: the committed iteration to evaluate (default: the latest).
        files: held-out parquet files (default: the config's ``data.val_files``).
        model: a Hugging Face model directory to evaluate instead of a checkpoint.

    Returns:
        ``{iteration, tag, out_dir, metrics, resumed}``.
    """
    cfg = resolve_config(config)
    files = list(files or cfg.data.val_files)
    if not files:
        raise ConfigError("nothing to evaluate on: set data.val_files in the config or pass files")
    cfg, checkpoint, out_dir, tag, n = target_of(cfg, iteration, files, model)
    logger = get_run_logger()
    # the policy and its engine; with its optimizer too when the state is rebuilt by replay
    rebuild = checkpoint is not None and not is_complete(checkpoint)
    roles = {"actor": "actor_rollout" if rebuild else "rollout"}
    what = f"iteration {n}" if n is not None else f"model {model}"
    logger.info(f"evaluating {what} of {ExperimentPaths.of(cfg).root} on {files} -> {out_dir}")
    key = f"eval-{uuid.uuid4().hex[:12]}"
    with ExperimentSession(cfg, logger, key, roles=roles, lock=False, preflight=False):
        result = with_retries(evaluate_checkpoint, cfg.resources.task_retries)(
            key, checkpoint, files, out_dir, tag
        )
    logger.info(evaluation_line(n if n is not None else 0, result["metrics"]))
    return {"iteration": n, "tag": tag, **result}
