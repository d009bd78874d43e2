"""The ``ppo-retrain`` flow: train, evaluate, promote when the rule holds. The nightly loop.

    prefect deployment run ppo-retrain/retrain                              # the embedded default
    prefect deployment run ppo-retrain/retrain -p config=experiments/my.yaml -p min_gain=0.01

One run:

1. the ``ppo`` flow as a subflow: ``iterations`` more iterations of the experiment, on its data
   stream (files that arrived since the last run join it: :mod:`ppoflow.infra.data.stream`);
2. the ``ppo-eval`` flow as a subflow on the last committed iteration, with ``files`` (default:
   the config's ``data.val_files``; an evaluation training already made is found, not redone);
3. the decision (:func:`ppoflow.infra.experiment.promotion.decide`): ``rule`` ``gain`` (``metric``
   more than the promoted policy's, by at least ``min_gain``; at least ``min_value``) or
   ``always``. A promotion publishes the iteration as a Hugging Face directory at
   ``<experiment>/promoted`` (swapped in whole) and a record in ``promoted.json`` and
   ``promotions/log/``.

Either way the run emits a Prefect event, ``ppoflow.policy.promoted`` or ``ppoflow.policy.kept``
(resource ``ppoflow.experiment.<name>``; the payload is the decision and the record: hang an
automation or a notification on it), and leaves a markdown artifact ``<experiment>-promotion``
with the decision and its numbers.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from ppoflow.flows.deployment import DEFAULT_DEMO_STORAGE, config_or_default
from ppoflow.flows.evaluate import evaluate
from ppoflow.flows.export import export_iteration
from ppoflow.flows.ppo import ppo
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.experiment.promotion import (
    Decision,
    check_promotable,
    current_promotion,
    decide,
    promoted_url,
    publish_promotion,
)
from ppoflow.tasks.step import artifact_slug

__all__ = ["retrain", "decision_markdown"]


def decision_markdown(experiment: str, n: int, metric: str, decision: Decision, url: str) -> str:
    """The run's decision as the flow-run artifact shows it."""
    verdict = "promoted" if decision.promote else "kept the promoted policy"

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    gain = None if decision.value is None or decision.current is None else decision.value - decision.current
    return (
        f"# {experiment}: iteration {n} {verdict}\n\n"
        f"| | |\n|---|---|\n| decision | **{'promoted' if decision.promote else 'kept'}** |\n"
        f"| metric | `{metric}` |\n| iteration {n} | {num(decision.value)} |\n"
        f"| promoted before | {num(decision.current)} |\n| gain | {num(gain)} |\n"
        f"| why | {decision.reason} |\n| promoted policy | `{url}` |\n"
    )


@flow(name="ppo-retrain", log_prints=False)
def retrain(
    config: ExperimentConfig | str | None = None,
    iterations: int = 1,
    metric: str = "val/score",
    rule: str = "gain",
    min_gain: float = 0.0,
    min_value: float | None = None,
    files: list[str] | None = None,
    demo_storage: str = DEFAULT_DEMO_STORAGE,
) -> dict[str, Any]:
    """Train ``iterations`` iterations, evaluate the result, promote it when the rule holds.

    Args:
        config: the experiment config, or a YAML path / fsspec URL; empty: the embedded default
            (the demo's tiny CPU experiment under ``demo_storage``).
        iterations: iterations to train before the evaluation (0: evaluate and decide only).
        metric: the evaluation metric the rule compares (higher is better).
        rule: ``gain`` (more than the promoted policy by at least ``min_gain``) or ``always``.
        min_gain: the least gain of ``metric`` over the promoted policy that promotes.
        min_value: the least value of ``metric`` that promotes (None: no floor).
        files: held-out parquet files (default: the config's ``data.val_files``).
        demo_storage: the embedded default's local directory; unused when ``config`` is given.

    Returns:
        ``{experiment, iteration, promoted, decision, record, url}``.
    """
    logger = get_run_logger()
    cfg = config_or_default(config, demo_storage)
    files = list(files or cfg.data.val_files)
    if not files:
        raise ConfigError("retraining evaluates before it promotes: set data.val_files or pass files")
    paths = ExperimentPaths.of(cfg)
    check_promotable(paths, rule, min_gain)  # before training, not after
    trained = ppo(cfg, iterations)
    n = int(trained["iteration"])
    evaluated = evaluate(cfg, iteration=n, files=files)
    metrics = {k: v for k, v in evaluated["metrics"].items() if isinstance(v, (int, float))}
    current = current_promotion(paths)
    decision = decide(rule, metric, metrics, current, min_gain=min_gain, min_value=min_value)
    record = None
    if decision.promote:
        how = {"rule": rule, "metric": metric, "min_gain": min_gain, "min_value": min_value}
        record = _promote(cfg, paths, n, metrics, how, logger)
    url = promoted_url(paths)
    experiment = cfg.storage.experiment
    _announce(experiment, n, metric, decision, record, url, logger)
    return {
        "experiment": experiment,
        "iteration": n,
        "promoted": decision.promote,
        "decision": decision.to_json(),
        "record": record,
        "url": url,
    }


def _promote(
    cfg: ExperimentConfig,
    paths: ExperimentPaths,
    n: int,
    metrics: dict[str, float],
    how: dict[str, Any],
    logger: Any,
) -> dict[str, Any]:
    """Publish iteration ``n`` as the promoted policy: its Hugging Face directory, then the
    record (its ``rule``: ``how``, the rule's settings). Returns the record."""
    from prefect.runtime import flow_run

    return publish_promotion(
        paths,
        n,
        lambda out: export_iteration(cfg, paths, n, out, say=logger.info),
        metric=how["metric"],
        metrics=metrics,
        rule=how,
        flow_run_id=str(flow_run.get_id()),
        warn=logger.warning,
    )


def _announce(
    experiment: str,
    n: int,
    metric: str,
    decision: Decision,
    record: dict[str, Any] | None,
    url: str,
    logger: Any,
) -> None:
    """Say the decision: the run's log, the Prefect event ``ppoflow.policy.promoted`` or
    ``ppoflow.policy.kept``, and the decision's markdown artifact."""
    logger.info(
        f"iteration {n}: {'promoted' if decision.promote else 'kept the promoted policy'} ({decision.reason})"
    )
    emit_event(
        event=f"ppoflow.policy.{'promoted' if decision.promote else 'kept'}",
        resource={
            "prefect.resource.id": f"ppoflow.experiment.{experiment}",
            "prefect.resource.name": experiment,
        },
        payload={
            "iteration": n,
            "metric": metric,
            "decision": decision.to_json(),
            "record": record,
            "url": url,
        },
    )
    create_markdown_artifact(
        decision_markdown(experiment, n, metric, decision, url),
        key=f"{artifact_slug(experiment)}-promotion",
        description=f"promotion decision after iteration {n}",
    )
