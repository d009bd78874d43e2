"""The promoted policy of an experiment: the rule that decides, the published directory, the records.

    <experiment>/
        promoted                         the promoted policy, a Hugging Face directory (a link to
                                         one of promotions/models/, swapped in one rename)
        promoted.json                    the current promotion's record
        promotions/models/000012/        the HF directory of iteration 12 (written once, whole)
        promotions/log/000003.json       every promotion and rollback, numbered

A record: ``{seq, action (promote | rollback), iteration, metric, value, metrics, rule, previous
(the record promoted before, or None), flow_run_id, at, model}``. A rollback makes the record
before the current one current again (its own record has that one's iteration and model, and its
``previous``), so rolling back twice goes two promotions back. A record's ``model`` is always
``promotions/models/<6 digits>`` (:data:`MODEL_REF`): one read back from storage that names
anything else is refused before anything is written.

The rule (:func:`decide`): ``always``; or ``gain``: the evaluation's ``metric`` must be more than
the promoted policy's by at least ``min_gain`` (any gain when ``min_gain`` is 0), and at least
``min_value`` when that is set. The first policy with the metric is promoted under ``gain``.

Readers of ``<experiment>/promoted`` see one whole directory, the old or the new: the directory is
written in full under ``promotions/models/`` first, then the link is replaced by one atomic
rename. The experiment's storage must be a local (or mounted) directory for that.

With ``MLFLOW_TRACKING_URI`` set, each promotion is also a version of the MLflow registered model
named after the experiment (:mod:`ppoflow.infra.experiment.tracking`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ppoflow.infra.config import ConfigError
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, now_iso

__all__ = [
    "RULES",
    "Decision",
    "PromotionError",
    "decide",
    "current_promotion",
    "promotion_log",
    "publish_promotion",
    "rollback_promotion",
    "promoted_url",
    "promotion_line",
    "check_promotable",
    "model_ref",
    "MODEL_REF",
]

RULES = ("gain", "always")
Rule = Literal["gain", "always"]


class PromotionError(ConfigError):
    """A promotion that cannot be made: nothing to roll back to, a remote experiment, ..."""


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded, with the numbers it compared."""

    promote: bool
    reason: str
    value: float | None
    current: float | None

    def to_json(self) -> dict[str, Any]:
        return {"promote": self.promote, "reason": self.reason, "value": self.value, "current": self.current}


def decide(
    rule: str,
    metric: str,
    metrics: dict[str, Any],
    current: dict[str, Any] | None,
    *,
    min_gain: float = 0.0,
    min_value: float | None = None,
) -> Decision:
    """Whether the policy evaluated to ``metrics`` replaces the ``current`` promotion record
    (None: none yet) under ``rule`` (see the module docstring)."""
    if rule not in RULES:
        raise PromotionError(f"promotion rule {rule!r}: expected one of {', '.join(RULES)}")
    value = metrics.get(metric)
    value = None if value is None else float(value)
    before = None if current is None or current.get("value") is None else float(current["value"])
    if current is not None and current.get("metric") not in (None, metric):
        before = None  # the promoted policy was judged on another metric
    if rule == "always":
        return Decision(True, "rule always", value, before)
    if value is None:
        return Decision(
            False, f"the evaluation has no {metric} (its metrics: {sorted(metrics)[:8]})", None, before
        )
    if min_value is not None and value < min_value:
        return Decision(False, f"{metric} {value:.4f} is below min_value {min_value:.4f}", value, before)
    if before is None:
        return Decision(True, f"no promoted policy with {metric} yet", value, before)
    gain = value - before
    if gain > 0 and gain >= min_gain:
        return Decision(True, f"{metric} gained {gain:+.4f} (min_gain {min_gain:g})", value, before)
    return Decision(
        False,
        f"{metric} gained {gain:+.4f}, not more than 0 and at least min_gain {min_gain:g}",
        value,
        before,
    )


def _local_root(paths: ExperimentPaths) -> str:
    fs, root = storage.url_to_fs(paths.root)
    if not storage.is_local(fs):
        raise PromotionError(
            f"{paths.root}: promotion publishes a directory swapped in by a local rename, so the "
            "experiment must be on a local or mounted filesystem; export-hf copies a policy anywhere"
        )
    return root


def check_promotable(paths: ExperimentPaths, rule: str, min_gain: float) -> None:
    """Refuse, before anything runs, a rule, a gain or an experiment a promotion cannot use."""
    if rule not in RULES:
        raise PromotionError(f"promotion rule {rule!r}: expected one of {', '.join(RULES)}")
    if min_gain < 0:
        raise PromotionError(f"min_gain={min_gain} must be >= 0 (0: any gain promotes)")
    _local_root(paths)


def promoted_url(paths: ExperimentPaths) -> str:
    """The stable URL of the promoted policy: ``<experiment>/promoted``."""
    return storage.join(paths.root, "promoted")


def current_promotion(paths: ExperimentPaths) -> dict[str, Any] | None:
    """The current promotion's record, or None if nothing was promoted."""
    url = storage.join(paths.root, "promoted.json")
    return storage.read_json(url) if storage.exists(url) else None


def promotion_log(paths: ExperimentPaths) -> list[dict[str, Any]]:
    """Every promotion and rollback record, oldest first."""
    log = storage.join(paths.root, "promotions", "log")
    if not storage.exists(log):
        return []
    return [
        storage.read_json(storage.join(log, name)) for name in storage.listdir(log) if name.endswith(".json")
    ]


#: The only targets ``<experiment>/promoted`` may point at: an iteration's directory under
#: ``promotions/models/`` (a record read back from storage that names anything else is refused).
MODEL_REF = re.compile(r"promotions/models/[0-9]{6}")


def model_ref(iteration: int) -> str:
    """``promotions/models/<iteration:06d>``: where iteration ``iteration``'s promoted policy lives."""
    if not 0 <= int(iteration) <= 999_999:
        raise PromotionError(f"iteration {iteration}: promotions are kept for iterations 0-999999")
    return f"promotions/models/{int(iteration):06d}"


def _check_model_ref(target_ref: Any) -> None:
    """Refuse a record whose model is not one of :data:`MODEL_REF`'s (before anything is written)."""
    if not isinstance(target_ref, str) or MODEL_REF.fullmatch(target_ref) is None:
        raise PromotionError(
            f"a promotion record names the model {target_ref!r}, not a directory promotions/models/"
            "NNNNNN of this experiment: the record was not written by ppoflow; restore promotions/log/"
        )


def _swap_link(root: str, target_ref: str) -> None:
    """Point ``<root>/promoted`` at ``target_ref`` (relative) in one rename."""
    _check_model_ref(target_ref)
    link = os.path.join(root, "promoted")
    if os.path.exists(link) and not os.path.islink(link):
        raise PromotionError(f"{link} exists and is not a link ppoflow made; move it away")
    tmp = os.path.join(root, f".promoted.{uuid.uuid4().hex[:8]}")
    os.symlink(target_ref, tmp)
    os.replace(tmp, link)


def _commit(paths: ExperimentPaths, record: dict[str, Any]) -> dict[str, Any]:
    root = _local_root(paths)
    _check_model_ref(record.get("model"))
    log = promotion_log(paths)
    record = {"seq": (log[-1]["seq"] + 1) if log else 1, **record, "at": now_iso()}
    storage.write_json_atomic(
        storage.join(paths.root, "promotions", "log", f"{record['seq']:06d}.json"), record
    )
    _swap_link(root, record["model"])
    storage.write_json_atomic(storage.join(paths.root, "promoted.json"), record)
    return record


def publish_promotion(
    paths: ExperimentPaths,
    iteration: int,
    export: Any,
    *,
    metric: str | None,
    metrics: dict[str, Any],
    rule: dict[str, Any],
    flow_run_id: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Promote iteration ``iteration``: its HF directory written by ``export(out_dir)`` (unless
    one was written before), then the record, the link, ``promoted.json``, and the MLflow model
    version when tracking (a tracking failure is ``warn``-ed, not raised). Returns the record."""
    root = _local_root(paths)
    ref = model_ref(iteration)
    if not os.path.isfile(os.path.join(root, ref, "config.json")):
        export(os.path.join(root, ref))  # export_hf: written in a sibling, renamed in whole
    current = current_promotion(paths)
    record = {
        "action": "promote",
        "iteration": iteration,
        "metric": metric,
        "value": None if metric is None or metrics.get(metric) is None else float(metrics[metric]),
        "metrics": metrics,
        "rule": rule,
        "previous": _brief(current),
        "flow_run_id": flow_run_id,
        "model": ref,
    }
    record = _commit(paths, record)
    from ppoflow.infra.experiment.tracking import MlflowTracker

    tracker = MlflowTracker.of(
        paths.root, os.path.basename(root.rstrip("/")), warn or logging.getLogger(__name__).warning
    )
    if tracker is not None:
        tracker.register_promotion(record, os.path.join(root, ref))
    return record


def _brief(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {k: record[k] for k in ("seq", "iteration", "metric", "value", "model")}


def rollback_promotion(paths: ExperimentPaths, flow_run_id: str | None = None) -> dict[str, Any]:
    """Make the promotion before the current one current again; returns the new record."""
    current = current_promotion(paths)
    if current is None or current.get("previous") is None:
        what = (
            "nothing was promoted"
            if current is None
            else f"iteration {current['iteration']} is the first promotion"
        )
        raise PromotionError(f"{paths.root}: nothing to roll back to ({what})")
    by_seq = {r["seq"]: r for r in promotion_log(paths)}
    back = by_seq[current["previous"]["seq"]]
    record = {
        **{k: back[k] for k in ("iteration", "metric", "value", "metrics", "rule", "model")},
        "action": "rollback",
        "rolled_back": _brief(current),
        "previous": back.get("previous"),
        "flow_run_id": flow_run_id,
    }
    return _commit(paths, record)


def promotion_line(record: dict[str, Any] | None) -> str:
    """One line about a promotion record (``ppoflow status``, the CLI)."""
    if record is None:
        return "-"
    value = "" if record.get("value") is None else f", {record['metric']} {record['value']:.4f}"
    how = "rolled back to" if record["action"] == "rollback" else "promoted"
    return f"iteration {record['iteration']}{value} ({how} {record['at']}, #{record['seq']})"
