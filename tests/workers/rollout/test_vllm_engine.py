"""The vLLM engine's settings from the ``rollout`` section, per platform (no engine is started):
CUDA graphs on GPU and eager on CPU by default, the KV budget (sized to the batch on GPU, checked
against vLLM's own page-size formula), sleep mode, the flashinfer sampler switch. Engines started
on ranks: test_vllm_rollout.py."""

from __future__ import annotations

import os

import pytest

from ppoflow.infra.config import ConfigError, RolloutConfig, parse_config
from ppoflow.workers.rollout.vllm_engine import (
    auto_kv_cache_bytes,
    engine_kwargs_for,
    kv_bytes_per_token,
    kv_cap_bytes,
    set_engine_env,
)

GIB = 2**30


def test_cpu_defaults_eager_and_fixed_kv_budget(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    kw = engine_kwargs_for(RolloutConfig(), cpu=True, tp_size=2, dp_rank=1)
    assert kw["enforce_eager"] is True and kw["kv_cache_memory_bytes"] == GIB // 4
    assert kw["tensor_parallel_size"] == 2 and kw["seed"] == 1
    assert "enable_sleep_mode" not in kw and "gpu_memory_utilization" not in kw
    assert "max_num_batched_tokens" not in kw
    assert kw["enable_chunked_prefill"] is False  # whole prompts a step (the dp2 scenario's wide wave)
    kw = engine_kwargs_for(
        RolloutConfig(kv_cache_gib=0.5, max_num_batched_tokens=4096), cpu=True, tp_size=1, dp_rank=0
    )
    assert kw["kv_cache_memory_bytes"] == GIB // 2 and kw["max_num_batched_tokens"] == 4096
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert "kv_cache_memory_bytes" not in engine_kwargs_for(RolloutConfig(), cpu=True, tp_size=1, dp_rank=0)


def test_gpu_defaults_graphs_sleep_mode_and_batch_sized_kv():
    cfg = RolloutConfig(max_num_seqs=512)
    kw = engine_kwargs_for(cfg, cpu=False, tp_size=1, dp_rank=0, kv_bytes=3 * GIB)
    assert kw["enforce_eager"] is False and kw["enable_sleep_mode"] is True
    assert kw["gpu_memory_utilization"] == cfg.gpu_memory_utilization and kw["max_num_seqs"] == 512
    assert kw["kv_cache_memory_bytes"] == 3 * GIB
    assert kw["logprobs_mode"] == "processed_logprobs" and "enable_chunked_prefill" not in kw
    with pytest.raises(ValueError, match="auto"):
        engine_kwargs_for(cfg, cpu=False, tp_size=1, dp_rank=0)
    profiled = engine_kwargs_for(RolloutConfig(kv_cache_gib=None), cpu=False, tp_size=1, dp_rank=0)
    assert "kv_cache_memory_bytes" not in profiled  # vLLM sizes it from gpu_memory_utilization
    fixed = engine_kwargs_for(RolloutConfig(kv_cache_gib=2.0), cpu=False, tp_size=1, dp_rank=0, kv_bytes=1)
    assert fixed["kv_cache_memory_bytes"] == 2 * GIB
    eager = engine_kwargs_for(
        RolloutConfig(enforce_eager=True, kv_cache_gib=1.0), cpu=False, tp_size=1, dp_rank=0
    )
    assert eager["enforce_eager"] is True
    graphs_on_cpu = engine_kwargs_for(RolloutConfig(enforce_eager=False), cpu=True, tp_size=1, dp_rank=0)
    assert graphs_on_cpu["enforce_eager"] is False


def test_auto_max_num_seqs_is_the_engines_share_of_the_batch():
    """One wave per rollout: auto is the engine's sequences (capped), a number given stays."""
    auto = RolloutConfig()
    assert engine_kwargs_for(auto, cpu=True, tp_size=1, dp_rank=0, sequences=1024)["max_num_seqs"] == 1024
    assert engine_kwargs_for(auto, cpu=True, tp_size=1, dp_rank=0, sequences=3)["max_num_seqs"] == 3
    assert engine_kwargs_for(auto, cpu=True, tp_size=1, dp_rank=0, sequences=10**5)["max_num_seqs"] == 1024
    assert engine_kwargs_for(auto, cpu=True, tp_size=1, dp_rank=0)["max_num_seqs"] == 256
    fixed = RolloutConfig(max_num_seqs=64)
    assert engine_kwargs_for(fixed, cpu=True, tp_size=1, dp_rank=0, sequences=1024)["max_num_seqs"] == 64


def test_auto_kv_budget_matches_vllms_page_formula(tmp_path):
    """Qwen2.5-0.5B: 24 layers, 2 KV heads of 64 dims, bf16. vLLM's page of a full-attention layer is
    2 (K and V) x block_size x kv_heads x head_size x dtype bytes (vllm/v1/kv_cache_interface.py)."""
    from transformers import Qwen2Config

    Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ).save_pretrained(tmp_path)
    per_token = kv_bytes_per_token(str(tmp_path), False, "bfloat16", 1)
    page = 2 * 16 * 2 * 64 * 2  # one layer's 16-token block
    assert per_token * 16 == 24 * page
    assert kv_bytes_per_token(str(tmp_path), False, "bfloat16", 2) == per_token // 2  # a KV head per rank
    assert kv_bytes_per_token(str(tmp_path), False, "bfloat16", 4) == per_token // 2  # replicated
    assert kv_bytes_per_token(str(tmp_path), False, "float32", 1) == 2 * per_token
    need = auto_kv_cache_bytes(per_token, sequences=256, max_model_len=768)
    blocks = 256 * (768 // 16 + 1)  # every sequence at full length, one spare block each
    assert need == int(1.25 * blocks * 24 * page)
    assert 2.8 * GIB < need < 2.9 * GIB  # vs ~40 GiB that gpu_memory_utilization 0.3 would map
    assert auto_kv_cache_bytes(per_token, sequences=1, max_model_len=16) == GIB  # the floor
    # reasoning lengths: 256 rows of 512 + 16384 tokens would want ~60 GiB; on one H200 (139 GiB)
    # at gpu_memory_utilization 0.3 the cap is 0.75 x 0.3 x 139 GiB ~ 31 GiB
    h200 = int(139.8 * GIB)
    long = auto_kv_cache_bytes(per_token, sequences=256, max_model_len=512 + 16384)
    cap = kv_cap_bytes(0.3, h200)
    assert long > 55 * GIB and cap == int(0.75 * 0.3 * h200)
    assert auto_kv_cache_bytes(per_token, sequences=256, max_model_len=512 + 16384, cap=cap) == cap
    assert auto_kv_cache_bytes(per_token, sequences=256, max_model_len=768, cap=cap) == need  # under it


def test_kv_cache_gib_config_values():
    assert RolloutConfig().kv_cache_gib == "auto"
    assert RolloutConfig(kv_cache_gib=None).kv_cache_gib is None
    assert RolloutConfig(kv_cache_gib=1.5).kv_cache_gib == 1.5
    base = {"model": {"path": "m"}, "data": {"train_files": ["x.parquet"]}}
    for bad in (0, -1, "big"):
        with pytest.raises(ConfigError, match="rollout.kv_cache_gib"):
            parse_config({**base, "rollout": {"kv_cache_gib": bad}})
    with pytest.raises(ConfigError, match="rollout.sleep_level"):
        parse_config({**base, "rollout": {"sleep_level": 3}})
    cfg = parse_config(
        {**base, "rollout": {"sleep_level": 1, "enforce_eager": None, "weight_loader": "dtensor"}}
    )
    assert (cfg.rollout.sleep_level, cfg.rollout.enforce_eager, cfg.rollout.weight_loader) == (
        1,
        None,
        "dtensor",
    )
    assert parse_config({**base, "rollout": {"sleep_level": 0}}).rollout.sleep_level == 0  # never sleeps


def test_default_sleep_level_per_engine_group():
    """Beside the trained actor: 2 (it pushes before every rollout); serving LoRA adapters: 1 (the
    base weights must survive); a group of its own (producer, evaluation): 0, never asleep; a
    configured level wins."""
    from ppoflow.workers.rollout.sharding_manager import engine_sleep_level

    assert engine_sleep_level(None, with_trained_actor=True, serves_adapters=False) == 2
    assert engine_sleep_level(None, with_trained_actor=True, serves_adapters=True) == 1
    assert engine_sleep_level(None, with_trained_actor=False, serves_adapters=False) == 0
    assert engine_sleep_level(1, with_trained_actor=False, serves_adapters=False) == 1
    assert engine_sleep_level(0, with_trained_actor=True, serves_adapters=False) == 0


def test_flashinfer_sampler_off_only_without_flashinfer(monkeypatch):
    import importlib.util

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    set_engine_env()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    missing = importlib.util.find_spec("flashinfer") is None
    assert os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") == ("0" if missing else None)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # the user's choice is kept
    set_engine_env()
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3_text", "qwen3"])
def test_a_hybrid_model_gets_the_settings_its_layers_need(arch, tmp_path):
    """Qwen3-Next's delta-net layers: no prefix caching on CPU; on GPU, vLLM's Triton prefill
    kernel where flashinfer is not installed (vLLM would pick FlashInfer's on Hopper and fail at the
    first prefill). Sliding-window attention (Gemma 3) and plain decoders get nothing."""
    import dataclasses
    import importlib.util

    from vllm.engine.arg_utils import EngineArgs

    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.workers.rollout.vllm_engine import model_engine_settings

    path = save_tiny_model(str(tmp_path / arch), arch=arch)
    cpu, gpu = (model_engine_settings(path, False, cpu=c) for c in (True, False))
    if arch != "qwen3_next":
        assert cpu == {} and gpu == {}
        return
    assert cpu == {"enable_prefix_caching": False}
    no_flashinfer = importlib.util.find_spec("flashinfer") is None
    assert gpu == ({"gdn_prefill_backend": "triton"} if no_flashinfer else {})
    # the installed vLLM takes it as an engine argument
    assert "gdn_prefill_backend" in {f.name for f in dataclasses.fields(EngineArgs)}
