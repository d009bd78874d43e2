"""What a model's ``config.json`` and the run's settings ask of the model matrix: the problems that
keep the run from working (each with where, what and the fix) and notes that are not errors.

    problems, notes = config_problems(json.load(open("model/config.json")), Settings(packing=True))

A ``model_type`` the matrix lacks is a note, not a refusal: ppoflow's seams are generic (the
checkpoint's own weight names, transformers' attention interface, vLLM's own loaders), so a model
close to a verified row usually works, and refusing it would refuse every new release until a row
is added. What the note says instead: nothing was verified for it, which rows were, and that the
``mismatch/*`` metrics of the first iteration are the check (a push the engine drops shows there).
What cannot work is refused whatever the matrix says, from the config alone: packed micro-batches
on layers that take no sequence boundaries (linear attention, state-space layers), a logit
soft-cap (the policy's chunked head applies none), a quantized checkpoint. For a row of the matrix,
anything the row does not support (packing, sequence parallelism, LoRA, tensor parallelism, the
engine dtype its CPU kernels need) is refused, naming the row and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ppoflow.infra.architectures.matrix import Architecture, architecture_of, names

__all__ = ["Settings", "config_problems", "hybrid_layers"]

#: ``layer_types`` entries of layers that transformers runs without sequence boundaries.
_NOT_ATTENTION = ("linear_attention", "mamba", "conv", "recurrent", "deltanet")


@dataclass(frozen=True)
class Settings:
    """What the run asks of the model: packed micro-batches (any of actor, reference, critic), the
    largest sequence-parallel size, LoRA, the engine's tensor parallelism, engine and its dtype, device."""

    packing: bool = False
    sequence_parallel: int = 1
    lora: bool = False
    lora_targets: str | tuple[str, ...] = "all-linear"
    tensor_parallel: int = 1
    engine: str = "vllm"
    engine_dtype: str = "float32"
    device: str = "cpu"


def hybrid_layers(config: dict[str, Any]) -> list[str]:
    """The kinds of layers of ``config`` that are not attention (``layer_types``), e.g. Qwen3-Next's
    ``linear_attention``; empty for a plain decoder."""
    kinds = config.get("layer_types") or []
    return sorted({k for k in kinds if any(word in str(k) for word in _NOT_ATTENTION)})


def _structural(config: dict[str, Any], settings: Settings, where: str) -> list[tuple[str, str, str]]:
    """What no row can run, read from the config alone."""
    out = []
    hybrid = hybrid_layers(config)
    if hybrid and (settings.packing or settings.sequence_parallel > 1):
        out.append(
            (
                where,
                f"its {', '.join(hybrid)} layers take no sequence boundaries in transformers, so "
                "packed micro-batches (and sequence parallelism) would mix the sequences of a row",
                "set actor.use_dynamic_bsz, ref.log_prob_use_dynamic_bsz and critic.use_dynamic_bsz "
                "to false and sequence_parallel_size to 1",
            )
        )
    if config.get("final_logit_softcapping") not in (None, 0, 1.0):
        out.append(
            (
                where,
                f"final_logit_softcapping={config['final_logit_softcapping']}: the policy's chunked "
                "log-prob head applies no soft-cap",
                "use a model without a logit soft-cap (Gemma 3, not Gemma 2)",
            )
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        out.append(
            (
                where,
                f"a quantized checkpoint ({method}): ppoflow trains and pushes unquantized weights",
                "start from the unquantized (bf16 or fp32) checkpoint",
            )
        )
    return out


def _row_problems(
    row: Architecture, config: dict[str, Any], s: Settings, where: str
) -> list[tuple[str, str, str]]:
    """What the row does not support of what the run asks."""
    out = []
    name = f"{row.family} ({row.name})"
    if s.packing and not row.packing:
        out.append(
            (
                where,
                f"{name} does not support packed micro-batches ({row.limits[0] if row.limits else ''})",
                "set actor.use_dynamic_bsz, ref.log_prob_use_dynamic_bsz and critic.use_dynamic_bsz to false",
            )
        )
    if s.sequence_parallel > 1 and not row.sequence_parallel:
        out.append(
            (where, f"{name} does not support sequence parallelism", "set sequence_parallel_size to 1")
        )
    if s.lora and not row.lora:
        out.append((where, f"{name} does not support LoRA adapters", "set actor.lora.rank to 0"))
    elif s.lora and row.lora_targets and not set(s.lora_targets) <= set(row.lora_targets):
        out.append(
            (
                where,
                f"LoRA on {name} with target_modules {s.lora_targets!r}: PEFT adapts its fused experts "
                "and router as 3-D parameters, which ppoflow does not merge into the engine's weights",
                f"set actor.lora.target_modules: [{', '.join(row.lora_targets)}]",
            )
        )
    if s.tensor_parallel > 1 and not row.tensor_parallel:
        out.append(
            (
                where,
                f"{name} does not support the engine's tensor parallelism",
                "set rollout.tensor_model_parallel_size to 1",
            )
        )
    return out + _engine_problems(row, config, s, where, name)


def _engine_problems(
    row: Architecture, config: dict[str, Any], s: Settings, where: str, name: str
) -> list[tuple[str, str, str]]:
    """What the row's vLLM engine cannot take of the run's settings and the config."""
    out = []
    cpu_vllm = s.engine == "vllm" and s.device == "cpu"
    if cpu_vllm and row.cpu_engine_dtype != "float32" and s.engine_dtype != row.cpu_engine_dtype:
        out.append(
            (
                where,
                f"vLLM's CPU build runs {name} in {row.cpu_engine_dtype} only, the engine dtype is {s.engine_dtype}",
                f"set rollout.dtype: {row.cpu_engine_dtype} (or rollout.engine: hf)",
            )
        )
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads") or 0
    if row.name == "gpt_oss" and s.engine == "vllm" and kv_heads and s.tensor_parallel > kv_heads:
        out.append(
            (
                where,
                f"rollout.tensor_model_parallel_size={s.tensor_parallel} is more than its {kv_heads} "
                "key/value heads: vLLM's GPT-OSS splits them and replicates none",
                f"set rollout.tensor_model_parallel_size to at most {kv_heads}",
            )
        )
    if row.name == "gpt_oss" and s.engine == "vllm" and config.get("rms_norm_eps", 1e-5) != 1e-5:
        out.append(
            (
                where,
                f"rms_norm_eps={config['rms_norm_eps']}: vLLM's GPT-OSS uses 1e-5 whatever the config "
                "says, so the engine's log-probs would differ from the trainer's",
                "use rms_norm_eps 1e-5 (the released models' value)",
            )
        )
    return out


def config_problems(
    config: dict[str, Any], settings: Settings, where: str = "model.path"
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """``(problems, notes)`` of a model's config (``config.json`` as a dict) under ``settings``:
    each problem ``(where, found, fix)``; see the module docstring for what is refused and why an
    architecture outside the matrix is a note (a row of the matrix gives none)."""
    model_type = config.get("model_type")
    problems = _structural(config, settings, where)
    row = architecture_of(model_type)
    if row is None:
        notes = [
            f"{where}: model_type {model_type!r} is not in ppoflow's model matrix (docs/models.md): "
            f"nothing was verified for it; the matrix has {', '.join(names())}. Watch the first "
            "iteration's mismatch/* metrics: a weight push the engine does not take shows there"
        ]
        return problems, notes
    return problems + _row_problems(row, config, settings, where), []
