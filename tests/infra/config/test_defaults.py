"""What a config leaves out, chosen when it loads (``ppoflow.infra.config.defaults``): the fast path
for a config of model, data and estimator, every value given kept, and the resolved config
round-tripping through its dump (what the ranks and the manifest get)."""

from __future__ import annotations

import copy

import pytest

from ppoflow.infra.config import ConfigError, apply_overrides, parse_config
from ppoflow.infra.config.system import visible_gpus

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}}


def _cfg(**over):
    return parse_config(apply_overrides(copy.deepcopy(BASE), over))


def test_a_minimal_config_gets_packing_budgets_and_a_critic_only_for_gae():
    cfg = _cfg()  # gae
    assert cfg.critic.enable is True
    assert (
        cfg.actor.use_dynamic_bsz and cfg.critic.use_dynamic_bsz and cfg.reward.reward_model.use_dynamic_bsz
    )
    assert cfg.actor.ppo_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu == 16384
    assert cfg.actor.log_prob_tokens == cfg.critic.forward_tokens == 32768  # twice the update's
    grpo = _cfg(**{"algorithm.adv_estimator": "grpo", "rollout.n": 2})
    assert grpo.critic.enable is False


def test_a_critic_nothing_reads_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as err:
        _cfg(**{"algorithm.adv_estimator": "rloo", "rollout.n": 2, "critic.enable": True})
    text = str(err.value)
    assert "critic.enable=true with algorithm.adv_estimator='rloo', which reads no values" in text
    assert "nothing would read it" in text and "(gae)" in text
    assert _cfg(**{"algorithm.adv_estimator": "rloo", "rollout.n": 2, "critic.enable": False})


def test_auto_budgets_hold_the_longest_row_per_rank():
    long = _cfg(**{"rollout.prompt_length": 8192, "rollout.response_length": 16384})
    assert long.actor.ppo_max_token_len_per_gpu == 24576 and long.actor.log_prob_tokens == 49152
    split = _cfg(
        **{
            "rollout.prompt_length": 8192,
            "rollout.response_length": 16384,
            "resources.nprocs": 2,
            "actor.sequence_parallel_size": 2,
        }
    )
    assert split.actor.ppo_max_token_len_per_gpu == 16384  # 24,576 over 2 ranks is below the floor
    given = _cfg(**{"actor.ppo_max_token_len_per_gpu": 4096, "actor.log_prob_max_token_len_per_gpu": 5000})
    assert given.actor.update_tokens == 4096 and given.actor.log_prob_tokens == 5000


def test_cuda_gets_bf16_compute_a_bf16_engine_compile_and_the_fused_head():
    cuda = _cfg(**{"resources.device": "cuda", "resources.nprocs": 1})
    assert (
        cuda.actor.fsdp.param_dtype == cuda.ref.fsdp.param_dtype == cuda.critic.fsdp.param_dtype == "bfloat16"
    )
    assert cuda.model.dtype == "float32"  # the master weights stay float32
    assert cuda.rollout.dtype == "bfloat16" and cuda.model.use_torch_compile is True
    assert cuda.actor.logprob_head == "fused"
    cpu = _cfg(**{"resources.device": "cpu"})
    assert cpu.actor.fsdp.param_dtype is None and cpu.rollout.dtype is None
    assert cpu.model.use_torch_compile is False and cpu.actor.logprob_head == "checkpoint"
    lora = _cfg(**{"resources.device": "cuda", "resources.nprocs": 1, "actor.lora.rank": 8})
    assert lora.model.use_torch_compile is False  # adapters are injected after compiling
    kept = _cfg(
        **{
            "resources.device": "cuda",
            "resources.nprocs": 1,
            "actor.fsdp.param_dtype": "float32",
            "rollout.dtype": "float32",
            "model.use_torch_compile": False,
            "actor.logprob_head": "checkpoint",
        }
    )
    assert (kept.actor.fsdp.param_dtype, kept.rollout.dtype) == ("float32", "float32")
    assert kept.model.use_torch_compile is False and kept.actor.logprob_head == "checkpoint"


def test_the_resolved_config_round_trips_through_its_dump():
    for over in (
        {},
        {"resources.device": "cuda", "resources.nprocs": 1},
        {"algorithm.adv_estimator": "grpo", "rollout.n": 2},
    ):
        cfg = _cfg(**over)
        again = parse_config(cfg.model_dump(mode="json"))
        assert again == cfg and again.config_hash() == cfg.config_hash()


def test_device_and_ranks_follow_the_gpus_this_host_shows(tmp_path, monkeypatch):
    driver = tmp_path / "gpus"
    driver.mkdir()
    for i in range(4):
        (driver / f"0000:0{i}:00.0").mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(str(driver)) == 4
    for shown, count in (("1,3", 2), ("", 0), ("-1", 0), ("0,-1,2", 1), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", shown)
        assert visible_gpus(str(driver)) == count, shown
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    # no GPU here (CI): auto is the CPU with 2 ranks, and a given value is kept
    assert visible_gpus() == 0
    cfg = _cfg()
    assert (cfg.resources.device, cfg.resources.nprocs) == ("cpu", 2)
    auto = _cfg(**{"resources.device": "auto", "resources.nprocs": "auto"})
    assert (auto.resources.device, auto.resources.nprocs) == ("cpu", 2)
    assert _cfg(**{"resources.device": "cuda", "resources.nprocs": 4}).resources.nprocs == 4
