"""A model's shape from its ``config.json`` (``ppoflow.infra.preflight.model_shape``): parameter
counts against the models transformers builds from the same configs (on the meta device: no
memory) and against published sizes, LoRA's adapters against PEFT's, the KV bytes of a token
against the rollout engine's own function, and the activation count against a hand count."""

from __future__ import annotations

import json

import pytest
import torch

from ppoflow.infra.config import LoRAConfig, ModelConfig
from ppoflow.infra.preflight.model_shape import (
    ACTIVATION_SCALE,
    FORWARD_LAYERS,
    HEAD_BYTES_PER_TOKEN,
    RECOMPUTE_LAYERS,
    activation_bytes_per_token,
    activation_path,
    forward_bytes_per_token,
    read_shape,
    shape_from_config,
)

SMALL = dict(
    hidden_size=128, intermediate_size=320, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
)
#: Published configs: Qwen2.5-0.5B (tied, q/k/v biases) and Llama-3.1-8B (untied).
QWEN_05B = dict(
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)


def _configs():
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3MoeConfig

    return [
        Qwen2Config(**SMALL, vocab_size=1000, tie_word_embeddings=True),
        LlamaConfig(**SMALL, vocab_size=1000, tie_word_embeddings=False),
        Qwen3MoeConfig(
            **{**SMALL, "num_hidden_layers": 2},
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            vocab_size=1000,
        ),
        MixtralConfig(
            **{**SMALL, "intermediate_size": 96}, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000
        ),
    ]


@pytest.mark.parametrize("index", range(4), ids=["qwen2-tied", "llama-untied", "qwen3-moe", "mixtral"])
def test_parameter_counts_equal_the_models_transformers_builds(index):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    config = _configs()[index]
    shape = shape_from_config(config.to_dict())
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(config)
    assert shape.params("lm") == sum(p.numel() for p in policy.parameters())
    if not shape.experts:  # the critic: the base with a value head (hidden -> 1), no LM head
        config.num_labels = 1
        with torch.device("meta"):
            critic = AutoModelForTokenClassification.from_config(config)
        assert shape.params("value") == sum(p.numel() for p in critic.parameters())


def test_published_sizes():
    assert shape_from_config(QWEN_05B).params() == 494_032_768  # Qwen2.5-0.5B, as published
    assert shape_from_config(LLAMA_8B).params() == 8_030_261_248  # Llama-3.1-8B


def test_lora_adapters_count_what_peft_adds():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SMALL, vocab_size=1000)
    shape = shape_from_config(config.to_dict())
    for targets in ("all-linear", ["q_proj", "v_proj"], ["mlp.down_proj"]):
        with torch.device("meta"):
            model = get_peft_model(
                AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules=targets)
            )
        added = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        assert shape.lora_params(LoRAConfig(rank=8, target_modules=targets)) == added, targets


def test_kv_bytes_equal_the_engines(tmp_path):
    from ppoflow.workers.rollout.vllm_engine import kv_bytes_per_token

    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    shape = read_shape(ModelConfig(path=str(tmp_path)))
    assert shape is not None
    for dtype, elem in (("bfloat16", 2), ("float32", 4)):
        for tp in (1, 2, 4):
            assert shape.kv_bytes_per_token(elem, tp) == kv_bytes_per_token(str(tmp_path), False, dtype, tp)
    assert shape.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2 == 12288


def test_activation_bytes_by_hand():
    shape = shape_from_config(QWEN_05B)
    # one layer keeps, in bf16: 4 x hidden (norms), 2 x q + 2 x kv (q, k, v, output), 3 x intermediate
    # (gate, up, product), and an fp32 log-sum-exp per head
    per_layer = 2 * (4 * 896 + 2 * 896 + 2 * 128 + 3 * 4864) + 4 * 14
    assert per_layer == shape.saved_bytes_per_token(2) == 40504
    compiled = activation_path("cuda", compiled=True, packed=True)
    scale = ACTIVATION_SCALE[compiled]
    full = activation_bytes_per_token(shape, 2, compiled, recompute=False)
    assert full == int(24 * per_layer * scale) + HEAD_BYTES_PER_TOKEN
    assert 1.0 * 2**20 < full < 1.2 * 2**20  # "about 1 MiB a token" (docs/gpus.md)
    recompute = activation_bytes_per_token(shape, 2, compiled, recompute=True)
    live = RECOMPUTE_LAYERS["gpu"] * per_layer * scale
    assert recompute == int(24 * 2 * 896 + live) + HEAD_BYTES_PER_TOKEN
    assert 24 * 2 * 896 == 43008  # the checkpointed inputs alone: the "45 KiB with recompute" of the docs
    forward = forward_bytes_per_token(shape, 2, compiled)
    assert forward == int(FORWARD_LAYERS * per_layer * scale) + HEAD_BYTES_PER_TOKEN
    eager = activation_bytes_per_token(shape, 2, activation_path("cuda", False, True), recompute=False)
    padded = activation_bytes_per_token(shape, 2, activation_path("cuda", False, False), recompute=False)
    assert eager > padded > full  # the measured order of the three GPU paths
    cpu = activation_path("cpu", compiled=False, packed=True)
    assert cpu == activation_path("cpu", compiled=True, packed=False) == "cpu"
    fp32 = shape.saved_bytes_per_token(4)
    assert activation_bytes_per_token(shape, 4, cpu, recompute=False) == int(24 * fp32 * 1.47) + 64


def test_read_shape_from_a_directory_with_overrides_and_nested_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_05B, "num_hidden_layers": 24}))
    plain = read_shape(ModelConfig(path=str(tmp_path)))
    over = read_shape(ModelConfig(path=str(tmp_path), override_config={"num_hidden_layers": 2}))
    assert plain is not None and over is not None and (plain.layers, over.layers) == (24, 2)
    nested = tmp_path / "vl"
    nested.mkdir()
    text = {k: v for k, v in QWEN_05B.items() if k != "tie_word_embeddings"}
    (nested / "config.json").write_text(json.dumps({"text_config": text, "tie_word_embeddings": True}))
    assert read_shape(ModelConfig(path=str(nested))) == plain
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert read_shape(ModelConfig(path=str(broken))) is None  # no layers: not a shape
    assert read_shape(ModelConfig(path=str(tmp_path / "absent"))) is None
    assert read_shape(ModelConfig(path="no-such-org/no-such-model")) is None  # a hub id not cached here


def test_gpt_oss_experts_keep_what_their_eager_loop_saves():
    """GPT-OSS (the matrix's real shape): per routed token its expert loop keeps the gathered input,
    the gate-up output (2 x), the clamped gate and up, the sigmoid, the GLU, the product and the
    expert's output: 2 x hidden + 7 x intermediate; a Qwen3-MoE-like config of the same sizes keeps
    SwiGLU's 3 x intermediate."""
    from ppoflow.infra.architectures.matrix import architecture_of

    row = architecture_of("gpt_oss")
    assert row is not None
    real = dict(row.real)
    shape = shape_from_config({**real, "model_type": "gpt_oss"})
    assert shape.expert_loop and (shape.hidden, shape.expert_intermediate) == (1024, 1024)
    attention = 4 * 1024 + 2 * 16 * 64 + 2 * 4 * 64
    per_layer = 2 * (attention + 4 * (2 * 1024 + 7 * 1024)) + 4 * 16 + 4 * 16
    assert shape.saved_bytes_per_token(2) == per_layer
    swiglu = shape_from_config({**real, "model_type": "qwen3_moe", "moe_intermediate_size": 1024})
    assert not swiglu.expert_loop
    assert swiglu.saved_bytes_per_token(2) == 2 * (attention + 4 * 3 * 1024) + 4 * 16 + 4 * 16
