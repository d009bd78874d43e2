"""Metric merge rules: what a worker declares with ``@register``, and the merge the driver applies
by them, against the plain arithmetic of the whole batch."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppoflow.infra.remote.metric_merge import MetricRule, merge_metrics

RATIO = MetricRule(pattern="*/rate", merge="ratio", of=("hits", "tries"))


def test_without_rules_every_metric_is_the_mean_of_the_shards_that_report_it():
    shards = [{"a_max": 1.0, "b": [1, 3], "n_per_episode": 2.0, "s": "text"}, {"a_max": 5.0}, None]
    assert merge_metrics(shards) == {"a_max": 3.0, "b": 2.0, "n_per_episode": 2.0}


def test_each_metric_takes_the_first_rule_it_matches():
    rules = (
        MetricRule(pattern="x/*", merge="min"),
        MetricRule(pattern="*_max", merge="max"),
        MetricRule(pattern="*count", merge="mean_or_zero"),
    )
    shards = [
        {"x/y_max": 4.0, "z_max": 4.0, "count": 3.0, "w": 1.0},
        {"x/y_max": 2.0, "z_max": 2.0, "w": 2.0},
    ]
    # x/y_max: min (the first rule); z_max: max; count: 3 in one shard of 2 -> 1.5; w: the mean
    assert merge_metrics(shards, rules) == {"x/y_max": 2.0, "z_max": 4.0, "count": 1.5, "w": 1.5}


def test_a_ratio_is_taken_of_the_merged_siblings():
    rules = (
        MetricRule(pattern="*/hits", merge="mean_or_zero"),
        MetricRule(pattern="*/tries", merge="mean_or_zero"),
        RATIO,
    )
    # shard 0: 4 rows, 2 tries, 1 hit; shard 1: 4 rows, 6 tries, 0 hits (no "hits" reported)
    shards = [{"t/hits": 0.25, "t/tries": 0.5, "t/rate": 0.5}, {"t/tries": 1.5, "t/rate": 0.0}]
    assert merge_metrics(shards, rules)["t/rate"] == pytest.approx(1 / 8)  # 1 hit of 8 tries
    # no numerator anywhere: the mean of the shards' rates; a zero denominator: 0
    assert merge_metrics([{"t/rate": 0.5}, {"t/rate": 0.0}], (RATIO,)) == {"t/rate": 0.25}
    assert merge_metrics([{"t/hits": 0.0, "t/tries": 0.0, "t/rate": 0.0}], (RATIO,))["t/rate"] == 0.0
    # a name without "/" has its siblings at the top level
    assert (
        merge_metrics(
            [{"rate": 1.0, "hits": 1.0, "tries": 4.0}], (RATIO.model_copy(update={"pattern": "rate"}),)
        )["rate"]
        == 0.25
    )


def test_ill_formed_rules_are_refused_where_they_are_declared():
    with pytest.raises(ValidationError, match="'of'"):
        MetricRule(pattern="*/rate", merge="ratio")
    with pytest.raises(ValidationError, match="'of'"):
        MetricRule(pattern="*_max", merge="max", of=("a", "b"))
    with pytest.raises(ValidationError, match="pattern"):
        MetricRule(pattern="", merge="max")
    with pytest.raises(ValidationError):
        MetricRule(pattern="*", merge="median")  # type: ignore[arg-type]
