"""The sampler/trainer mismatch in what a person sees of an iteration: the console line (one
number, where the rollout measured it), the UI's trend table, the manifest's trend, MLflow's names."""

from __future__ import annotations

from ppoflow.infra.experiment.metrics import TREND_KEYS, headline_line, metrics_table, trend_markdown
from ppoflow.infra.experiment.tracking import _numbers


def test_the_console_line_shows_token_mult_prob_error_only_where_measured():
    measured = {
        "critic/score/mean": 0.5,
        "mismatch/token_mult_prob_error": 1.01234,
        "timing_s/iteration": 2.0,
    }
    assert "| mismatch 1.0123 |" in headline_line(3, measured)
    assert "mismatch" not in headline_line(3, {"critic/score/mean": 0.5, "timing_s/iteration": 2.0})
    assert "mismatch/token_mult_prob_error" in TREND_KEYS  # kept per iteration in the manifest
    md = trend_markdown("exp", [{"iteration": 1, **measured}])
    assert "mismatch" in md and "1.012" in md


def test_every_mismatch_and_correction_metric_reaches_the_table_and_mlflow():
    metrics = {
        "mismatch/kl_k3": 1e-4,
        "mismatch/abs_log_ratio_max": 0.5,
        "correction/masked_token_share": 0.1,
    }
    assert {row["metric"] for row in metrics_table(metrics)} == set(metrics)
    assert set(_numbers(metrics)) == set(metrics)
