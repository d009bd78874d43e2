"""ppoflow.infra.experiment.metrics: the data metrics of a batch, the reduction over ranks, the headline line and the trend."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.experiment.metrics import (
    compute_data_metrics,
    headline_line,
    is_timing_key,
    reduce_rank_metrics,
    trend_markdown,
)


def test_data_metrics_on_a_hand_made_batch():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = {
        "response_mask": mask,
        "responses": torch.zeros(2, 3, dtype=torch.long),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]]),
        "token_level_rewards": torch.tensor([[0.0, 0.5, 9.0], [0.0, 0.0, 2.5]]),
        "advantages": torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]]),
        "returns": torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]),
        "values": torch.tensor([[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]),
    }
    m = compute_data_metrics(batch)
    assert m["critic/score/mean"] == 2.0 and m["critic/score/max"] == 3.0
    assert m["critic/rewards/mean"] == 1.5  # the 9.0 is off the mask
    assert m["critic/advantages/mean"] == pytest.approx(2.0) and m["critic/advantages/max"] == 3.0
    assert m["critic/vf_explained_var"] == pytest.approx(1.0, abs=1e-4)  # perfect values
    assert m["response_length/mean"] == 2.5 and m["response_length/clip_ratio"] == 0.5
    assert m["prompt_length/mean"] == 1.5 and m["perf/total_num_tokens"] == 8.0


def test_rank_reduction_and_text():
    assert reduce_rank_metrics([{"a": 1.0, "b": [1, 3], "s": "x"}, {"a": 3.0}, None]) == {"a": 2.0, "b": 2.0}
    assert is_timing_key("timing_s/generate") and is_timing_key("weight_sync_s")
    assert is_timing_key("rollout/tokens_per_s") and not is_timing_key("actor/pg_loss")
    line = headline_line(3, {"critic/rewards/mean": 0.25, "actor/ppo_kl": 0.001, "timing_s/iteration": 1.5})
    assert line == (
        "iteration    3 | score - | reward 0.250 | kl 0.0010 | entropy - | response length - | 1.5 s"
    )
    # the KL shown is the one the run optimises against: in the reward before the loss before PPO's
    line = headline_line(4, {"actor/ppo_kl": 0.5, "actor/reward_kl_penalty": 0.25})
    assert "kl 0.2500" in line
    md = trend_markdown(
        "exp", [{"iteration": 1, "critic/rewards/mean": 0.1}, {"iteration": 2, "critic/rewards/mean": 0.4}]
    )
    assert "| iteration | reward |" in md and "| 2 | 0.4 |" in md
    assert "reward: 0.1 (iteration 1) → 0.4 (iteration 2)" in md


def test_one_metrics_spec_feeds_the_trend_and_the_plot():
    from ppoflow.infra.experiment.metrics import HEADLINES, TREND_KEYS
    from ppoflow.infra.experiment.plots import panels

    plotted = {key for _, _, series in panels() for key, _ in series}
    assert plotted <= set(TREND_KEYS)  # everything plotted is kept in the manifest's trend
    assert {h.name for h in HEADLINES} >= {"score", "reward", "kl", "entropy", "response length"}
    assert panels()[0][0] == "Reward" and [k for k, _ in panels()[0][2]] == [
        "critic/score/mean",
        "critic/rewards/mean",
    ]


def test_iteration_line_tolerates_missing_metrics():
    line = headline_line(3, {"critic/score/mean": 0.5, "timing_s/iteration": 2.0})
    assert (
        line.startswith("iteration    3 | score 0.500 | reward -")
        and "kl -" in line
        and line.endswith("2.0 s")
    )
