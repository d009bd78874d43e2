"""Fast checks of the flow's helpers: fault injection, metrics math, the retry rule, seeds, where
iterations start (one-step overlap) and when receipts are reused."""

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
from ppoflow.infra.runtime import faults


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
    from ppoflow.infra.runtime.rank_entry import parse_faults

    spec = "rank_raise:checkpoint_write:1,rank_raise:checkpoint_write:0:always"
    assert parse_faults(spec) == {
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


def test_retry_rule_skips_config_errors_only():
    from prefect.states import Failed

    from ppoflow.infra.config import ConfigError
    from ppoflow.infra.experiment.lock import ExperimentLocked
    from ppoflow.tasks.step import retryable

    def failed(exc):
        return Failed(data=exc)

    assert retryable(None, None, failed(RuntimeError("rank 1 died")))
    assert retryable(None, None, failed(faults.FaultInjected("drill")))
    assert not retryable(None, None, failed(ConfigError("bad field")))
    assert not retryable(None, None, failed(ExperimentLocked("held")))


def test_iteration_seed_depends_on_the_seeds_and_the_iteration_only():
    from ppoflow.tasks.generate import iteration_seed

    assert iteration_seed(7, 0, 3) == iteration_seed(7, 0, 3)
    assert len({iteration_seed(7, 0, n) for n in range(1, 50)}) == 49
    assert iteration_seed(8, 0, 3) != iteration_seed(7, 0, 3) != iteration_seed(7, 1, 3)
    assert 0 <= iteration_seed(7, 0, 3) < 2**31


def test_device_slots_are_a_strict_limit_created_on_first_use(prefect_harness, flow_config, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    from ppoflow.infra.config import ConfigError
    from ppoflow.tasks.slots import device_slots, limit_name

    cfg = flow_config(str(tmp_path), "x", **{"resources.nprocs": 4})
    logs: list[str] = []
    with device_slots(cfg, logs.append) as held:
        assert held["slots"] == min(4, held["size"])  # more CPU ranks than cores: all, no refusal
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(limit_name("cpu"))
        assert limit.active_slots == held["size"]
        with pytest.raises(TimeoutError):  # a second run on this machine waits for the slots
            with concurrency(
                limit_name("cpu"), occupy=held["size"] - held["slots"] + 1, strict=True, timeout_seconds=1
            ):
                pass
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(limit_name("cpu")).active_slots == 0
    gpu = flow_config(str(tmp_path), "x", **{"resources.device": "cuda", "resources.nprocs": 4})
    with pytest.raises(ConfigError, match="prefect gcl update ppoflow-cuda-"):
        with device_slots(gpu, logs.append):
            pass


def _receipts(n: int, paths, critic: bool = True):
    from ppoflow.tasks.receipts import AdvantageReceipt, GenerateReceipt, IterationReceipts, Receipt

    gen = GenerateReceipt(task="generate", iteration=n, next_cursor={"epoch": 0, "offset": 4 * n}, seed=1)
    adv = AdvantageReceipt(task="advantage", iteration=n, kl_coef=0.1 * n)
    updates = [Receipt(task="update_actor", iteration=n, checkpoints={"actor": paths.checkpoint("actor", n)})]
    if critic:
        updates.append(
            Receipt(task="update_critic", iteration=n, checkpoints={"critic": paths.checkpoint("critic", n)})
        )
    return IterationReceipts(generate=gen, advantage=adv, updates=updates)


def test_where_iterations_start_with_and_without_one_step_overlap():
    from ppoflow.flows.schedule import Start
    from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest

    paths = ExperimentPaths("/x/exp")
    ck = paths.checkpoint
    manifest = Manifest(
        experiment="exp",
        iteration=4,
        actor_checkpoint="checkpoints/actor/000004",
        critic_checkpoint="checkpoints/critic/000004",
        config_hash="h",
        identity={},
        data_cursor={"epoch": 0, "offset": 16},
        kl_coef=0.4,
        created_at="t",
        committed_at="t",
        rollout_checkpoints={"actor": "checkpoints/actor/000003", "critic": "checkpoints/critic/000003"},
    )
    plain, overlap = Start.of(paths, manifest, one_step=False), Start.of(paths, manifest, one_step=True)
    assert (plain.rollout_actor, plain.rollout_critic) == (ck("actor", 4), ck("critic", 4))
    assert (overlap.rollout_actor, overlap.rollout_critic) == (ck("actor", 3), ck("critic", 3))
    assert plain.actor == overlap.actor == ck("actor", 4) and plain.rollout_record() is None
    nxt = overlap.after(_receipts(5, paths), one_step=True)
    assert (nxt.iteration, nxt.actor, nxt.rollout_actor, nxt.rollout_critic) == (
        5,
        ck("actor", 5),
        ck("actor", 4),
        ck("critic", 4),
    )
    assert nxt.cursor == {"epoch": 0, "offset": 20} and nxt.kl_coef == 0.5
    assert nxt.rollout_record() == {"actor": ck("actor", 4), "critic": ck("critic", 4)}
    nxt = plain.after(_receipts(5, paths, critic=False), one_step=False)
    assert nxt.rollout_actor == nxt.actor == ck("actor", 5) and nxt.critic == nxt.rollout_critic == ck(
        "critic", 4
    )
    # a manifest written without overlap (no record) makes the first one-step iteration on-policy
    switched = Start.of(paths, Manifest(**{**manifest.to_json(), "rollout_checkpoints": None}), one_step=True)
    assert switched.rollout_actor == ck("actor", 4)


def test_receipts_are_reused_only_with_the_same_inputs(tmp_path):
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths
    from ppoflow.tasks.receipts import GenerateReceipt, Receipt, find_receipt, input_stamps, write_receipt

    paths = ExperimentPaths(str(tmp_path / "exp"))
    out = paths.file(2, "rollout.arrow")
    storage.write_bytes_atomic(out, b"x")
    gen = write_receipt(
        paths,
        GenerateReceipt(
            task="generate",
            iteration=2,
            outputs={"rollout": out},
            next_cursor={"epoch": 0, "offset": 8},
            seed=3,
        ),
    )
    assert gen.stamp and storage.read_json(paths.receipt(2, "generate"))["stamp"] == gen.stamp
    inputs = input_stamps(paths, (paths.checkpoint("actor", 1), {"epoch": 0, "offset": 4}), {})
    assert inputs == {"0": "checkpoints/actor/000001", "1": '{"epoch": 0, "offset": 4}'}
    stored = write_receipt(paths, gen.model_copy(update={"inputs": inputs}))
    assert find_receipt(paths, 2, "generate", GenerateReceipt, inputs=inputs).stamp == stored.stamp
    other = input_stamps(paths, (paths.checkpoint("actor", 0), {"epoch": 0, "offset": 4}), {})
    assert find_receipt(paths, 2, "generate", GenerateReceipt, inputs=other) is None
    # downstream tasks name the receipts they consume by stamp: a recomputed rollout changes them
    down = input_stamps(paths, (stored,), {})
    assert down == {"0": f"generate:{stored.stamp}"}
    again = write_receipt(paths, stored.model_copy(update={"stamp": ""}))
    assert input_stamps(paths, (again,), {}) != down
    assert isinstance(Receipt(task="t", iteration=1).inputs, dict)
