"""Promotion: the rule, the directory at the stable URL swapped whole, the records, rollback."""

from __future__ import annotations

import os

import pytest
import torch

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.experiment.promotion import (
    PromotionError,
    check_promotable,
    current_promotion,
    decide,
    promoted_url,
    promotion_log,
    publish_promotion,
    rollback_promotion,
)


@pytest.mark.parametrize(
    "rule, value, current, min_gain, min_value, promote",
    [
        ("always", 0.1, 0.9, 0.0, None, True),
        ("gain", 0.5, None, 0.0, None, True),  # nothing promoted yet
        ("gain", 0.5, 0.4, 0.0, None, True),
        ("gain", 0.4, 0.4, 0.0, None, False),  # no gain
        ("gain", 0.45, 0.4, 0.1, None, False),  # gain below min_gain
        ("gain", 0.55, 0.4, 0.1, None, True),
        ("gain", 0.5, None, 0.0, 0.6, False),  # below the floor
        ("gain", None, 0.4, 0.0, None, False),  # the metric is missing
    ],
)
def test_the_rule(rule, value, current, min_gain, min_value, promote):
    metrics = {} if value is None else {"val/score": value}
    record = None if current is None else {"metric": "val/score", "value": current}
    d = decide(rule, "val/score", metrics, record, min_gain=min_gain, min_value=min_value)
    assert d.promote is promote, d.reason
    assert (d.value, d.current) == (value, current)


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_publish_swaps_the_directory_whole_and_rollback_goes_back(tmp_path):
    paths = ExperimentPaths(str(tmp_path / "exp"))
    os.makedirs(paths.root)
    refs = {n: _weights(save_tiny_model(str(tmp_path / f"ref-{n}"), seed=n)) for n in (2, 5)}

    def export(seed):
        return lambda out: save_tiny_model(out, seed=seed)

    first = publish_promotion(paths, 2, export(2), metric="val/score", metrics={"val/score": 0.3}, rule={})
    assert (first["seq"], first["action"], first["previous"]) == (1, "promote", None)
    assert _same(_weights(promoted_url(paths)), refs[2])
    held = os.path.realpath(promoted_url(paths))  # a reader that resolved the URL before the swap

    second = publish_promotion(
        paths, 5, export(5), metric="val/score", metrics={"val/score": 0.4}, rule={}, flow_run_id="abc"
    )
    assert second["previous"] == {
        "seq": 1,
        "iteration": 2,
        "metric": "val/score",
        "value": 0.3,
        "model": "promotions/models/000002",
    }
    assert _same(_weights(promoted_url(paths)), refs[5]) and current_promotion(paths) == second
    assert _same(_weights(held), refs[2])  # the old directory is still whole
    assert os.listdir(paths.root).count("promoted") == 1 and not [
        n for n in os.listdir(paths.root) if n.startswith(".promoted")
    ]

    back = rollback_promotion(paths)
    assert (back["seq"], back["action"], back["iteration"], back["previous"]) == (3, "rollback", 2, None)
    assert back["rolled_back"]["iteration"] == 5
    assert _same(_weights(promoted_url(paths)), refs[2])
    assert [r["action"] for r in promotion_log(paths)] == ["promote", "promote", "rollback"]
    with pytest.raises(PromotionError, match="nothing to roll back to"):
        rollback_promotion(paths)


def test_a_remote_experiment_a_bad_rule_or_gain_are_refused_before_anything_runs(tmp_path):
    paths = ExperimentPaths("memory://bucket/exp")
    with pytest.raises(PromotionError, match="must be on a local or mounted filesystem"):
        publish_promotion(paths, 1, lambda out: None, metric=None, metrics={}, rule={})
    with pytest.raises(PromotionError, match="must be on a local or mounted filesystem"):
        check_promotable(paths, "gain", 0.0)
    local = ExperimentPaths(str(tmp_path))
    check_promotable(local, "always", 0.0)
    with pytest.raises(PromotionError, match="rule 'best': expected one of gain, always"):
        check_promotable(local, "best", 0.0)
    with pytest.raises(PromotionError, match="min_gain=-1.0 must be >= 0"):
        check_promotable(local, "gain", -1.0)


def test_a_record_naming_a_model_outside_promotions_is_refused_before_anything_is_written(tmp_path):
    import json

    paths = ExperimentPaths(str(tmp_path / "exp"))
    os.makedirs(paths.root)
    publish_promotion(paths, 2, lambda out: save_tiny_model(out, seed=2), metric=None, metrics={}, rule={})
    publish_promotion(paths, 3, lambda out: save_tiny_model(out, seed=3), metric=None, metrics={}, rule={})
    first = os.path.join(paths.root, "promotions", "log", "000001.json")
    record = json.load(open(first))
    record["model"] = "../../elsewhere"  # a record ppoflow did not write
    json.dump(record, open(first, "w"))
    before = sorted(os.listdir(os.path.join(paths.root, "promotions", "log")))
    with pytest.raises(PromotionError, match=r"names the model '\.\./\.\./elsewhere'"):
        rollback_promotion(paths)
    assert sorted(os.listdir(os.path.join(paths.root, "promotions", "log"))) == before
    assert os.readlink(promoted_url(paths)) == "promotions/models/000003"
