"""Fast checks of the flow's helpers: fault injection, metrics math, the retry rule, seeds, where
iterations start (one-step overlap) and when receipts are reused."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra import faults
from ppoflow.infra.experiment.metrics import (
    compute_data_metrics,
    headline_line,
    is_timing_key,
    reduce_rank_metrics,
    trend_markdown,
)


@pytest.fixture(autouse=True)
def _fresh_faults():
    faults.reset()
    yield
    faults.reset()


def test_task_entries_can_name_an_iteration(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "task:commit@2:before:always")
    faults.maybe_fail("commit", "before", 1)
    faults.maybe_fail("commit", "before")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected, match="commit@2"):
            faults.maybe_fail("commit", "before", 2)
    for bad in ("task:commit@:before", "task:commit@x:before", "task:@2:before"):
        with pytest.raises(ValueError, match="bad entry"):
            faults.parse(bad)


def test_rank_points_fire_on_their_rank_once_or_always(monkeypatch):
    spec = "rank_raise:checkpoint_write:1,rank_raise:checkpoint_write:0:always"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    assert faults.rank_entries() == {
        ("rank_raise", "checkpoint_write", 1),
        ("rank_raise", "checkpoint_write", 0),
    }
    monkeypatch.setenv(faults.ENV_VAR, spec)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(faults.FaultInjected, match="checkpoint_write on rank 1"):
        faults.rank_point(faults.CHECKPOINT_WRITE)
    faults.rank_point(faults.CHECKPOINT_WRITE)  # once
    faults.rank_point("some_other_point")
    monkeypatch.setenv("RANK", "0")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected, match="rank 0"):
            faults.rank_point(faults.CHECKPOINT_WRITE)


def test_fault_entries_fire_once_or_always(monkeypatch):
    monkeypatch.setenv(
        faults.ENV_VAR,
        "task:advantage:before, task:commit:after:always,"
        "rank_exit:update_actor:1,rank_raise:compute_values:0:always",
    )
    with pytest.raises(faults.FaultInjected, match="advantage"):
        faults.maybe_fail("advantage", "before")
    faults.maybe_fail("advantage", "before")  # fired once: the retry passes
    faults.maybe_fail("advantage", "after")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected):
            faults.maybe_fail("commit", "after")
    # the ranks get only rank entries (':always' kept for points inside methods, see rank_point)
    assert faults.rank_fault_env() == {
        faults.ENV_VAR: "rank_exit:update_actor:1,rank_raise:compute_values:0:always"
    }
    faults.note_rank_failure("update_actor")
    faults.note_rank_failure("compute_values")
    assert faults.rank_fault_env() == {faults.ENV_VAR: "rank_raise:compute_values:0:always"}
    monkeypatch.delenv(faults.ENV_VAR)
    assert faults.rank_fault_env() == {faults.ENV_VAR: ""}  # never inherit task entries


@pytest.mark.parametrize("bad", ["task:generate:during", "rank_exit:update_actor:x", "boom", "task:x"])
def test_bad_fault_entries_name_the_allowed_forms(monkeypatch, bad):
    monkeypatch.setenv(faults.ENV_VAR, bad)
    with pytest.raises(ValueError, match="allowed: task:<task>:before|after"):
        faults.maybe_fail("generate", "before")


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


def test_retry_rule_fails_deterministic_errors_at_once_and_retries_the_rest():
    from botocore.exceptions import NoCredentialsError
    from prefect.states import Failed

    from ppoflow.infra.checkpoint.sharded import CheckpointError, IncompleteCheckpointError
    from ppoflow.infra.config import ConfigError
    from ppoflow.infra.data.prompts import DataError
    from ppoflow.infra.experiment.lock import ExperimentLocked
    from ppoflow.infra.experiment.manifest import IdentityMismatch
    from ppoflow.infra.preflight import PreflightError, Problem
    from ppoflow.infra.remote.errors import RankFailure, error_types
    from ppoflow.infra.rewards import RewardError
    from ppoflow.tasks.step import retryable

    def failed(exc):
        return Failed(data=exc)

    def in_rank(exc):
        return RankFailure(f"rank 1 raised: {exc}", rank=1, method="m", error_types=tuple(error_types(exc)))

    permanent = [
        ConfigError("bad field"),
        IdentityMismatch("model.path changed"),
        DataError("no prompt column"),
        PreflightError([Problem("data.train_files", "missing", "fix it")]),
        RewardError("non-finite score"),
        IncompleteCheckpointError("no marker"),
        ExperimentLocked("held"),
        PermissionError("AccessDenied"),
        NoCredentialsError(),
        in_rank(DataError("row 3")),
        in_rank(IncompleteCheckpointError("no marker")),
    ]
    transient = [
        RuntimeError("rank 1 died"),
        RankFailure("rank 1 died during 'update_actor' (its link closed)", rank=1, method="update_actor"),
        in_rank(ValueError("a bug that may be flaky")),
        faults.FaultInjected("drill"),
        OSError(121, "We encountered an internal error. Please try again."),  # S3 500 via s3fs
        TimeoutError("call timed out"),
        CheckpointError("saving checkpoint s3://b/x failed: ..."),  # a failed save may pass next time
    ]
    assert [exc for exc in permanent if retryable(None, None, failed(exc))] == []
    assert [exc for exc in transient if not retryable(None, None, failed(exc))] == []


def test_iteration_seed_depends_on_the_seeds_and_the_iteration_only():
    from ppoflow.tasks.generate import iteration_seed

    assert iteration_seed(7, 0, 3) == iteration_seed(7, 0, 3)
    assert len({iteration_seed(7, 0, n) for n in range(1, 50)}) == 49
    assert iteration_seed(8, 0, 3) != iteration_seed(7, 0, 3) != iteration_seed(7, 1, 3)
    assert 0 <= iteration_seed(7, 0, 3) < 2**31
