"""The model matrix: one row per architecture ppoflow supports, and what each row was verified for.

A row says how to build the architecture (its transformers config class, the tiny configuration
the tests use, the real small shape the GPU benchmark uses) and what it supports: packed
(variable-length) micro-batches, LoRA, the rollout engine's tensor parallelism, sequence
parallelism (Ulysses), and which engine and dtype run it on vLLM's CPU build. Every "supported"
here is what ``tests/scenarios/test_model_matrix.py`` checks for the row on CPU ranks; docs/models.md
gives the table with the figures measured. Pure data: the flow's process imports it (the config
check) without torch.

    row = architecture_of(config_json["model_type"])     # None outside the matrix
    row.packing, row.sequence_parallel, row.moe          # what a config may ask of it"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["Architecture", "ARCHITECTURES", "architecture_of", "names", "TINY_COMMON"]

#: What every tiny configuration shares: two layers of hidden 64, two query heads of 32 (vLLM's
#: CPU attention takes head sizes 32, 64, 80, ...), one key/value head (grouped-query attention).
TINY_COMMON: Mapping[str, Any] = MappingProxyType(
    dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=512,
    )
)
#: The tiny sliding window: shorter than the tests' sequences, so that the window matters.
TINY_WINDOW = 32
#: Llama 3.x's rope scaling (3.1 and later), tiny and real alike.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500_000.0,
    factor=32.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)


def _frozen(**kw: Any) -> Mapping[str, Any]:
    return MappingProxyType(kw)  # tiny.py copies the values (a config may change its dicts)


@dataclass(frozen=True)
class Architecture:
    """One row of the matrix.

    Attributes:
        name: the row's key: the ``model_type`` of its config (``qwen3_moe``).
        family: what users call it (``Qwen3-MoE``).
        config_class, causal_lm: the transformers config class and causal-LM class names.
        tiny: the tiny config's own fields (on top of :data:`TINY_COMMON`).
        tied: whether the tiny model (and the real small one) ties its input and output embeddings.
        real_name: the real small shape the GPU benchmark builds (what it is, or how it is scaled).
        real: that shape's config fields (random weights; the demo's tokenizer fits any vocabulary).
        moe: mixture-of-experts layers (expert weights pushed into vLLM's fused-expert layout,
            router metrics ``actor/moe/*``; FSDP only: no expert parallelism).
        lora_targets: the LoRA target modules the row needs instead of ``all-linear`` (None:
            ``all-linear`` works). PEFT adapts Qwen3-MoE's fused experts and router as 3-D
            parameters under ``all-linear``; ppoflow merges and syncs linear adapters only.
        packing, lora, tensor_parallel, sequence_parallel: verified on CPU ranks (see module docstring).
        cpu_engine, cpu_engine_dtype: the rollout engine (and its dtype) that runs the row on CPU.
        seams: what is particular at the seams (weight layouts, attention, rope), one line.
    """

    name: str
    family: str
    config_class: str
    causal_lm: str
    tiny: Mapping[str, Any]
    tied: bool
    real_name: str
    real: Mapping[str, Any]
    moe: bool = False
    packing: bool = True
    lora: bool = True
    tensor_parallel: bool = True
    sequence_parallel: bool = True
    cpu_engine: Literal["vllm", "hf"] = "vllm"
    cpu_engine_dtype: str = "float32"
    seams: str = ""
    limits: tuple[str, ...] = field(default=())
    lora_targets: tuple[str, ...] | None = None

    @property
    def model_type(self) -> str:
        return self.name


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="qwen2",
        family="Qwen2 / Qwen2.5",
        config_class="Qwen2Config",
        causal_lm="Qwen2ForCausalLM",
        tiny=_frozen(),
        tied=True,
        real_name="Qwen2.5-0.5B",
        real=_frozen(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,
        ),
        seams="q/k/v biases; tied head (vLLM's CPU build re-packs it after a push)",
    ),
    Architecture(
        name="qwen3",
        family="Qwen3",
        config_class="Qwen3Config",
        causal_lm="Qwen3ForCausalLM",
        tiny=_frozen(head_dim=32),
        tied=True,
        real_name="Qwen3-0.6B",
        real=_frozen(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            tie_word_embeddings=True,
        ),
        seams="per-head q/k RMS norms; head_dim apart from hidden / heads",
    ),
    Architecture(
        name="qwen3_moe",
        family="Qwen3-MoE",
        config_class="Qwen3MoeConfig",
        causal_lm="Qwen3MoeForCausalLM",
        tiny=_frozen(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
        tied=False,
        real_name="Qwen3-30B-A3B's layers (hidden 1024 for 2048, 12 layers for 48, 32 experts for 128), about 1.3B",
        real=_frozen(
            hidden_size=1024,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=3072,
            moe_intermediate_size=768,
            num_experts=32,
            num_experts_per_tok=8,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        moe=True,
        seams="experts trained as fused 3-D tensors, pushed per expert (the checkpoint's names)",
        limits=(
            "LoRA on the attention projections only (actor.lora.target_modules: [q_proj, k_proj, v_proj, o_proj])",
        ),
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    ),
    Architecture(
        name="llama",
        family="Llama 3.x",
        config_class="LlamaConfig",
        causal_lm="LlamaForCausalLM",
        tiny=_frozen(
            head_dim=32,
            max_position_embeddings=16384,  # llama3 scaling: above its original context
            rope_parameters=_LLAMA3_ROPE,
        ),
        tied=True,
        real_name="Llama-3.2-1B",
        real=_frozen(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_parameters=_LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
        seams="llama3 rope scaling (inv_freq rebuilt after to_empty); tied head at 1B/3B",
    ),
    Architecture(
        name="gemma3_text",
        family="Gemma 3 (text)",
        config_class="Gemma3TextConfig",
        causal_lm="Gemma3ForCausalLM",
        tiny=_frozen(
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
        tied=True,
        real_name="Gemma-3-1B (text)",
        real=_frozen(
            hidden_size=1152,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            intermediate_size=6912,
            vocab_size=262144,
            sliding_window=512,
            max_position_embeddings=32768,
            layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            },
            tie_word_embeddings=True,
        ),
        seams="scaled embedding, (1 + w) norms, q/k norms, sliding-window layers with their own rope",
    ),
    Architecture(
        name="mistral",
        family="Mistral",
        config_class="MistralConfig",
        causal_lm="MistralForCausalLM",
        tiny=_frozen(head_dim=32, sliding_window=TINY_WINDOW),
        tied=False,
        real_name="Mistral-7B-v0.3's layer shape at 16 layers of hidden 2048, about 0.9B",
        real=_frozen(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=5632,
            vocab_size=32768,
            max_position_embeddings=32768,
            sliding_window=None,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        seams="sliding window on every layer (v0.1) or none (v0.3)",
    ),
    Architecture(
        name="phi3",
        family="Phi-3",
        config_class="Phi3Config",
        causal_lm="Phi3ForCausalLM",
        tiny=_frozen(sliding_window=TINY_WINDOW),
        tied=False,
        real_name="Phi-3-mini-4k (3.8B)",
        real=_frozen(
            hidden_size=3072,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=8192,
            vocab_size=32064,
            max_position_embeddings=4096,
            sliding_window=2047,
            rms_norm_eps=1e-5,
        ),
        seams="fused qkv_proj and gate_up_proj in the checkpoint itself; sliding window",
        limits=("the engine takes qkv_proj whole with TP: no pre-sliced push for it",),
    ),
    Architecture(
        name="olmo2",
        family="OLMo 2",
        config_class="Olmo2Config",
        causal_lm="Olmo2ForCausalLM",
        tiny=_frozen(),
        tied=False,
        real_name="OLMo-2-0425-1B",
        real=_frozen(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            intermediate_size=8192,
            vocab_size=100352,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
        ),
        seams="q/k norms over whole projections, norms after attention and MLP; vLLM runs it "
        "through its Transformers backend, which patches transformers' own class in the rank",
    ),
    Architecture(
        name="gpt_oss",
        family="GPT-OSS",
        config_class="GptOssConfig",
        causal_lm="GptOssForCausalLM",
        tiny=_frozen(
            head_dim=32,
            num_key_value_heads=2,  # vLLM's GPT-OSS shards key/value heads, never replicates them
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=131072,  # yarn x32 of 4096, as released
        ),
        tied=False,
        real_name="GPT-OSS-20B's design (alternating 128-token windows, sinks, 32 experts) at hidden 1024, "
        "12 layers, 16 experts top-4, about 1.1B",
        real=_frozen(
            hidden_size=1024,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=1024,
            num_local_experts=16,
            num_experts_per_tok=4,
            vocab_size=201088,
            sliding_window=128,
            max_position_embeddings=131072,
        ),
        moe=True,
        seams="attention sinks, alternating sliding windows, yarn rope, expert biases; experts pushed "
        "one by one into the CPU build (its reload skips fused-expert copies), fused on GPU",
        limits=(
            "unquantized only (no MXFP4 checkpoints)",
            "vLLM's GPT-OSS norms use eps 1e-5 whatever the config says",
            "the engine's tensor parallelism at most the key/value heads (vLLM replicates none)",
        ),
    ),
    Architecture(
        name="qwen3_next",
        family="Qwen3-Next (hybrid attention)",
        config_class="Qwen3NextConfig",
        causal_lm="Qwen3NextForCausalLM",
        tiny=_frozen(
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"],
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
        ),
        tied=False,
        real_name="Qwen3-Next-80B-A3B's design (3 gated-delta layers to 1 attention layer, shared "
        "expert) at hidden 1024, 12 layers, 32 experts top-4, about 1B",
        real=_frozen(
            hidden_size=1024,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            intermediate_size=3072,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=4,
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            vocab_size=151936,
            max_position_embeddings=32768,
        ),
        moe=True,
        packing=False,
        sequence_parallel=False,
        cpu_engine_dtype="bfloat16",
        seams="gated delta-net layers (no segment boundaries in transformers: padded micro-batches "
        "only), MoE with a shared expert; vLLM's CPU build runs them in bf16 without prefix caching",
        limits=(
            "no packing and so no sequence parallelism: the delta-net layers of transformers take no "
            "sequence boundaries",
            "on CPU the engine samples in bf16 (vLLM's CPU delta-net kernel), the trainer in fp32",
            "LoRA on the attention projections only (actor.lora.target_modules: [q_proj, k_proj, v_proj, o_proj])",
        ),
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"),
    ),
)

_BY_TYPE = {row.name: row for row in ARCHITECTURES}


def architecture_of(model_type: str | None) -> Architecture | None:
    """The row of a config's ``model_type`` (None when the matrix has none)."""
    return _BY_TYPE.get(model_type or "")


def names() -> list[str]:
    """Every row's ``model_type``, in the matrix's order."""
    return [row.name for row in ARCHITECTURES]
