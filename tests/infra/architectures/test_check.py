"""The config check of the model matrix (ppoflow.infra.architectures.check): what cannot work is
refused with the fix, an architecture outside the matrix is a note listing the rows."""

from __future__ import annotations

from ppoflow.infra.architectures import Settings, config_problems

QWEN3_NEXT = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}


def test_a_row_refuses_what_it_does_not_support():
    problems, _ = config_problems(QWEN3_NEXT, Settings(packing=True, sequence_parallel=2))
    found = " | ".join(p[1] for p in problems)
    assert "linear_attention layers take no sequence boundaries" in found
    assert "Qwen3-Next (hybrid attention) (qwen3_next) does not support packed micro-batches" in found
    assert "does not support sequence parallelism" in found
    assert all(p[0] == "model.path" and p[2] for p in problems)
    problems, _ = config_problems(QWEN3_NEXT, Settings(engine="vllm", device="cpu", engine_dtype="float32"))
    assert [p[2] for p in problems] == ["set rollout.dtype: bfloat16 (or rollout.engine: hf)"]
    assert config_problems(QWEN3_NEXT, Settings(engine_dtype="bfloat16"))[0] == []
    assert config_problems(QWEN3_NEXT, Settings(device="cuda"))[0] == []


def test_moe_rows_take_sequence_parallelism_and_gpt_oss_its_own_epsilon():
    assert config_problems({"model_type": "qwen3_moe"}, Settings(packing=True, sequence_parallel=2))[0] == []
    problems, _ = config_problems({"model_type": "gpt_oss", "rms_norm_eps": 1e-6}, Settings())
    assert len(problems) == 1 and "vLLM's GPT-OSS uses 1e-5" in problems[0][1]
    assert config_problems({"model_type": "gpt_oss", "rms_norm_eps": 1e-5}, Settings())[0] == []
    problems, _ = config_problems(
        {"model_type": "gpt_oss", "num_key_value_heads": 1}, Settings(tensor_parallel=2)
    )
    assert [p[2] for p in problems] == ["set rollout.tensor_model_parallel_size to at most 1"]


def test_what_no_row_can_run_is_refused_even_outside_the_matrix():
    config = {
        "model_type": "gemma2",
        "final_logit_softcapping": 30.0,
        "quantization_config": {"quant_method": "mxfp4"},
        "layer_types": ["mamba", "attention"],
    }
    problems, notes = config_problems(config, Settings(packing=True))
    found = [p[1] for p in problems]
    assert any("mamba layers take no sequence boundaries" in f for f in found)
    assert any("final_logit_softcapping=30.0" in f for f in found)
    assert any("a quantized checkpoint (mxfp4)" in f for f in found)
    assert "model_type 'gemma2' is not in ppoflow's model matrix" in notes[0]
    # outside the matrix and nothing structural: a note only, no refusal
    assert (
        config_problems({"model_type": "granite"}, Settings(packing=True, sequence_parallel=2, lora=True))[0]
        == []
    )


def test_lora_on_fused_experts_is_refused_with_the_targets_that_work():
    problems, _ = config_problems({"model_type": "qwen3_moe"}, Settings(lora=True))
    assert len(problems) == 1 and "PEFT adapts its fused experts" in problems[0][1]
    assert problems[0][2] == "set actor.lora.target_modules: [q_proj, k_proj, v_proj, o_proj]"
    attention = Settings(lora=True, lora_targets=("q_proj", "v_proj"))
    assert config_problems({"model_type": "qwen3_moe"}, attention)[0] == []
    assert config_problems({"model_type": "gpt_oss"}, Settings(lora=True))[0] == []  # no conversion there
