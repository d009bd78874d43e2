"""How the metrics of a DP_COMPUTE_PROTO method merge over its data-parallel shards: the rules a
worker declares with the method, and the merge the driver applies by them.

A DataProto output of such a method is made on each dp rank from an equal share of the batch, and
each share's ``meta_info["metrics"]`` describes that share only. The worker that names the metrics
knows how the shares make the whole batch's value; the driver must not (it knows no metric
names). So the worker declares it, beside the method's dispatch mode::

    @register(Dispatch.DP_COMPUTE_PROTO, metrics=(
        MetricRule(pattern="*_max", merge="max"),
        MetricRule(pattern="*/error_rate", merge="ratio", of=("errors_per_episode", "calls_per_episode")),
    ))
    def generate_sequences(self, prompts: DataProto) -> DataProto: ...

Each metric takes the first rule whose ``pattern`` (``fnmatch``, case-sensitive; ``*`` also
matches ``/``) matches its name; a metric no rule matches is the mean over the shards that report
it. The rules travel to the driver in the rank's :class:`~ppoflow.infra.remote.protocol.Reply` of
each call, beside the output they describe, so :func:`merge_metrics` needs nothing but the replies:
the driver keeps no per-method state beyond the dispatch mode, and a merge can be checked from
hand-made replies alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["MetricRule", "merge_metrics"]

#: ``mean``: over the shards that report the metric. ``max`` / ``min``: the largest / smallest.
#: ``mean_or_zero``: over all shards, a shard that does not report the metric counting 0 (a per-row
#: average of events a shard without any leaves out). ``ratio``: ``of[0] / of[1]`` of the merged
#: batch, both siblings of the metric (the same name up to its last ``/``); 0 where ``of[1]`` is 0
#: or missing, the mean where ``of[0]`` is missing.
Merge = Literal["mean", "max", "min", "mean_or_zero", "ratio"]


class MetricRule(BaseModel):
    """How the metrics whose names match ``pattern`` merge over data-parallel shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str
    merge: Merge
    of: tuple[str, str] | None = None

    @model_validator(mode="after")
    def _of_for_ratio_only(self) -> MetricRule:
        if not self.pattern:
            raise ValueError("a metric rule needs a pattern (e.g. '*_max')")
        if (self.merge == "ratio") != (self.of is not None):
            raise ValueError(
                f"rule {self.pattern!r}: 'of' (numerator, denominator) is for merge='ratio' "
                f"and required there, got merge={self.merge!r}, of={self.of!r}"
            )
        return self


def _number(value: Any) -> float | None:
    """A shard's value as one number: a number (or bool) itself, a list its numbers' mean."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        nums = [v for v in (_number(x) for x in value) if v is not None]
        return sum(nums) / len(nums) if nums else None
    return None


def _rule(key: str, rules: Sequence[MetricRule]) -> MetricRule | None:
    return next((r for r in rules if fnmatchcase(key, r.pattern)), None)


def merge_metrics(
    per_shard: Sequence[dict[str, Any] | None], rules: Sequence[MetricRule] = ()
) -> dict[str, float]:
    """The metrics of one batch from those of its equal data-parallel shards, by ``rules``.

    Non-numeric values are dropped; ratios are taken after every other metric is merged."""
    keys = list(dict.fromkeys(k for m in per_shard for k in (m or {})))
    out: dict[str, float] = {}
    for key in keys:
        values = [v for v in (_number((m or {}).get(key)) for m in per_shard) if v is not None]
        if not values:
            continue
        how = getattr(_rule(key, rules), "merge", "mean")
        if how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        elif how == "mean_or_zero":
            out[key] = sum(values) / len(per_shard)
        else:  # a ratio starts as the mean, kept where its numerator is missing
            out[key] = sum(values) / len(values)
    for key in keys:
        rule = _rule(key, rules)
        if rule is None or rule.of is None:
            continue
        base = key.rpartition("/")[0] + "/" if "/" in key else ""
        num, den = (base + name for name in rule.of)
        if num in out:
            out[key] = out[num] / out[den] if out.get(den) else 0.0
    return out
