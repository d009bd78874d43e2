"""ppoflow.infra.experiment.evaluation and the evaluation config: the metrics of one evaluation
against a hand computation (mean@n, best@n, pass@n per data source), the tag of a file list, and
the settings a config refuses."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ConfigError, parse_config
from ppoflow.infra.experiment.evaluation import VAL_TAG, eval_tag, evaluation_metrics
from ppoflow.infra.experiment.metrics import evaluation_line, headline_line, trend_markdown


def test_metrics_of_two_sources_with_three_responses_each():
    # prompt 0 (a): 1, 0, 0   prompt 1 (a): 0, 0, 0   prompt 2 (b): 0.5, 1, 1
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    sources = ["a"] * 6 + ["b"] * 3
    scores = [1, 0, 0, 0, 0, 0, 0.5, 1, 1]
    lengths = [3, 4, 5, 1, 1, 1, 10, 20, 30]
    m = evaluation_metrics(index, sources, scores, lengths, n=3, pass_threshold=1.0)
    assert m["val/score"] == pytest.approx(3.5 / 9)
    assert m["val/prompts"] == 3 and m["val/responses"] == 9
    assert m["val/a/score/mean@3"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["val/a/score/best@3"] == pytest.approx(0.5) and m["val/a/pass@3"] == pytest.approx(0.5)
    assert m["val/b/score/mean@3"] == pytest.approx(2.5 / 3)
    assert m["val/b/score/best@3"] == 1.0 and m["val/b/pass@3"] == 1.0
    assert m["val/a/response_length/mean"] == pytest.approx(15 / 6) and m["val/b/response_length/mean"] == 20
    assert m["val/best@3"] == pytest.approx((1 + 0 + 1) / 3) and m["val/pass@3"] == pytest.approx(2 / 3)


def test_one_response_per_prompt_has_no_best_or_pass():
    m = evaluation_metrics([0, 1], ["a", "a"], [0.25, 0.75], [2, 2], n=1, pass_threshold=1.0)
    assert m["val/a/score/mean@1"] == 0.5 == m["val/score"]
    assert not [k for k in m if "best@" in k or "pass@" in k]


def test_the_threshold_decides_what_passes():
    m = evaluation_metrics([0, 0, 1, 1], ["a"] * 4, [0.6, 0.2, 0.4, 0.1], [1] * 4, n=2, pass_threshold=0.5)
    assert m["val/a/pass@2"] == 0.5


def test_a_file_list_has_a_tag():
    assert eval_tag(["v.parquet"], ["v.parquet"]) == VAL_TAG
    other = eval_tag(["w.parquet"], ["v.parquet"])
    assert other.startswith("files-") and other == eval_tag(["w.parquet"], []) != eval_tag(["x.parquet"], [])


def test_sampled_best_of_n_needs_a_temperature():
    base = {"model": {"path": "m"}, "data": {"train_files": ["t"], "val_files": ["v"]}}
    with pytest.raises(ConfigError, match=r"evaluation.n=4 with evaluation.temperature=0"):
        parse_config({**base, "evaluation": {"n": 4}})
    cfg = parse_config({**base, "evaluation": {"n": 4, "temperature": 0.7}})
    assert cfg.evaluation.n == 4 and cfg.data.val_files == ["v"]


def test_when_training_evaluates():
    from ppoflow.tasks.evaluate import due

    base = {"model": {"path": "m"}, "data": {"train_files": ["t"], "val_files": ["v"]}}
    cfg = parse_config({**base, "evaluation": {"every": 3, "at_end": False}})
    assert [n for n in range(1, 10) if due(cfg, n, last_of_run=False)] == [3, 6, 9]
    assert due(parse_config({**base, "evaluation": {"every": 0}}), 5, last_of_run=True)  # at_end
    assert not due(parse_config({**base, "evaluation": {"every": 0, "at_end": False}}), 5, last_of_run=True)
    assert not due(
        parse_config({"model": {"path": "m"}, "data": {"train_files": ["t"]}}), 5, last_of_run=True
    )


def test_the_line_shows_the_held_out_score_only_where_it_ran():
    plain = {"critic/score/mean": 0.25, "timing_s/iteration": 2.0}
    assert "val" not in headline_line(1, plain)
    line = headline_line(2, {**plain, "val/score": 0.5})
    assert "| val 0.500 |" in line and line.index("response length") < line.index("val")
    assert evaluation_line(0, {"val/score": 0.125, "val/prompts": 8, "val/pass@4": 0.5}, " (x)") == (
        "iteration    0 | val 0.125 | pass@4 0.500 | 8 prompts (x)"
    )
    md = trend_markdown(
        "e", [{"iteration": 0, "val/score": 0.1}, {"iteration": 1}, {"iteration": 2, "val/score": 0.4}]
    )
    assert "val: 0.1 (iteration 0) → 0.4 (iteration 2)" in md


def test_evaluation_labels_are_names_whatever_the_files_are_called():
    import re

    from ppoflow.infra.config.names import NAME_PATTERN

    for files in (["../../x.parquet"], ["s3://b/a b/c.parquet", "/etc/passwd"], ["v.parquet"]):
        assert re.fullmatch(NAME_PATTERN, eval_tag(files, ["v.parquet"]))
