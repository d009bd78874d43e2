"""``asynchronous``: what asynchronous training accepts, the one error naming the fix for what it
does not run with, and the producer's placement as its flow runs it."""

from __future__ import annotations

import copy

import pytest

from ppoflow.infra.config import ConfigError, apply_overrides, parse_config

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["d.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
    "resources": {"nprocs": 2, "device": "cuda", "visible_devices": "0"},
}


def _cfg(**over):
    return parse_config(apply_overrides(copy.deepcopy(BASE), {"asynchronous.enable": True, **over}))


def test_defaults_are_off_and_staleness_zero():
    cfg = parse_config(copy.deepcopy(BASE))
    a = cfg.asynchronous
    assert not a.enable and a.max_staleness == 0 and a.in_flight == "continue"
    assert a.producer.start == "with_trainer" and a.producer.nprocs is None
    assert [a.first_version(n) for n in (1, 2, 3)] == [0, 1, 2]  # batch n: version n - 1 only


def test_the_bound_gives_the_oldest_version_a_batch_may_hold():
    a = _cfg(**{"asynchronous.max_staleness": 2}).asynchronous
    assert [a.first_version(n) for n in (1, 2, 3, 4, 10)] == [0, 0, 0, 1, 7]


def test_the_producer_runs_on_its_own_placement():
    cfg = _cfg(**{"asynchronous.producer.nprocs": 1, "asynchronous.producer.visible_devices": "1"})
    p = cfg.producer_config()
    assert (p.resources.nprocs, p.resources.visible_devices, p.resources.device) == (1, "1", "cuda")
    assert p.resources.launch == "local" and cfg.resources.nprocs == 2  # the trainer's is unchanged
    shared = _cfg().producer_config()  # one GPU: both groups on the trainer's device
    assert (shared.resources.nprocs, shared.resources.visible_devices) == (2, "0")


@pytest.mark.parametrize(
    "over, words",
    [
        ({"algorithm.overlap": "one_step"}, "algorithm.overlap=one_step"),
        ({"algorithm.dynamic_sampling.enable": True, "rollout.n": 2}, "algorithm.dynamic_sampling"),
        ({"rollout.multi_turn.enable": True}, "rollout.multi_turn"),
        ({"actor.lora.rank": 8}, "actor.lora"),
        (
            {"asynchronous.max_staleness": 1, "rollout.calculate_log_probs": False},
            "set rollout.calculate_log_probs=true",
        ),
        (
            {"asynchronous.producer.nprocs": 3, "rollout.tensor_model_parallel_size": 2},
            "asynchronous.producer.nprocs=3 must be a multiple",
        ),
    ],
)
def test_what_it_does_not_run_with_is_refused_naming_the_fix(over, words):
    with pytest.raises(ConfigError, match="asynchronous") as err:
        _cfg(**over)
    assert words in str(err.value)


def test_sequence_parallelism_composes_when_the_producer_has_the_actors_layout():
    sp = {"actor.sequence_parallel_size": 2, "actor.use_dynamic_bsz": True}
    assert _cfg(**sp).asynchronous.enable
    with pytest.raises(ConfigError, match="actor.sequence_parallel_size=2"):
        _cfg(**sp, **{"asynchronous.producer.nprocs": 1})


@pytest.mark.parametrize(
    "over, dtype",
    [
        ({"rollout.engine": "vllm", "rollout.dtype": "bfloat16"}, "bfloat16"),  # the GPU default
        ({"rollout.engine": "vllm", "rollout.dtype": "float16"}, "float16"),
        ({"rollout.engine": "vllm"}, "bfloat16"),  # unset on cuda: a bf16 engine
        ({"rollout.engine": "vllm", "rollout.dtype": "float32"}, None),  # the model's float32
        ({"rollout.engine": "vllm", "rollout.dtype": "bfloat16", "model.dtype": "bfloat16"}, None),
        ({"rollout.engine": "hf", "rollout.dtype": "bfloat16"}, None),  # samples with the module itself
    ],
)
def test_policy_versions_are_published_in_a_narrower_engine_dtype(over, dtype):
    assert _cfg(**over).policy_version_dtype == dtype
