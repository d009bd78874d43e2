"""The Hugging Face models the workers run: the three kinds, their config with the experiment's
overrides, loading from a checkpoint or building from a config, and the parts of a model the
sharding and the training need (its decoder layers, gradient checkpointing).

    hf = load_hf_model(cfg.model, "causal_lm")                    # on CPU, a full copy
    hf = model_from_config(hf_config(cfg.model, "causal_lm"), "causal_lm")   # random weights
    decoder_layers(hf)                                            # the blocks FSDP shards one by one

Kinds: ``causal_lm`` (the policy), ``token_classification`` (the critic: one label, no head
dropout) and ``sequence_classification`` (the reward model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from transformers import PreTrainedModel

    from ppoflow.infra.config import ModelConfig

__all__ = [
    "MODEL_KINDS",
    "torch_dtype",
    "hf_config",
    "load_hf_model",
    "model_from_config",
    "copy_generation_config",
    "decoder_layers",
    "enable_gradient_checkpointing",
]

MODEL_KINDS = ("causal_lm", "token_classification", "sequence_classification")


def torch_dtype(name: str | None) -> torch.dtype | None:
    """'bfloat16' -> torch.bfloat16; None stays None."""
    return None if name is None else getattr(torch, name)


def _auto_class(kind: str):
    """The transformers Auto class of a model kind."""
    import transformers

    classes = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_classification": transformers.AutoModelForTokenClassification,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }
    if kind not in classes:
        raise ValueError(f"unknown model kind {kind!r}; allowed: {', '.join(MODEL_KINDS)}")
    return classes[kind]


def _kind_overrides(kind: str) -> dict[str, Any]:
    """Config fields a kind forces: the critic is a one-label token classifier without dropout
    (the default head dropout is 0.1, which would make values non-deterministic)."""
    if kind == "token_classification":
        return {"num_labels": 1, "classifier_dropout": 0.0}
    return {}


def hf_config(model_cfg: ModelConfig, kind: str):
    """The model's transformers config with ``override_config`` and the kind's forced fields."""
    import transformers

    hf_cfg = transformers.AutoConfig.from_pretrained(
        model_cfg.path, trust_remote_code=bool(model_cfg.trust_remote_code)
    )
    for key, value in {**model_cfg.override_config, **_kind_overrides(kind)}.items():
        setattr(hf_cfg, key, value)
    return hf_cfg


def load_hf_model(model_cfg: ModelConfig, kind: str, dtype: str | None = None) -> PreTrainedModel:
    """Load a Hugging Face model on the CPU with ``from_pretrained`` (a full copy: the actor's and
    the critic's workers call it on rank 0 only, through ``build_fsdp_model``). A head the checkpoint lacks (a critic's
    ``score`` on top of a causal LM) is initialised from torch's global RNG.

    ``trust_remote_code`` comes only from ``model_cfg``; ``override_config`` is applied to the
    loaded config. Returns the model in eval mode (callers switch to train mode to update).
    """
    trust = bool(model_cfg.trust_remote_code)
    model = _auto_class(kind).from_pretrained(
        model_cfg.path,
        config=hf_config(model_cfg, kind),
        trust_remote_code=trust,
        dtype=torch_dtype(dtype or model_cfg.dtype),
    )
    model.eval()
    return model


def model_from_config(
    hf_cfg, kind: str, dtype: str = "float32", trust_remote_code: bool = False
) -> PreTrainedModel:
    """A randomly initialised model of ``kind`` from a transformers config (benchmarks, tests)."""
    for key, value in _kind_overrides(kind).items():
        setattr(hf_cfg, key, value)
    model = _auto_class(kind).from_config(
        hf_cfg, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
    )
    model.eval()
    return model


def copy_generation_config(model_cfg: ModelConfig, hf: PreTrainedModel) -> None:
    """Give a model built from its config the checkpoint's ``generation_config.json`` (stop ids, ...)."""
    if getattr(hf, "generation_config", None) is None:
        return
    try:
        from transformers import GenerationConfig

        hf.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
    except (OSError, ValueError):
        pass


def decoder_layers(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class is in the HF model's ``_no_split_modules``."""
    names: set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or [])
    config = getattr(module, "config", None)
    if not names and config is not None:
        raise ValueError(
            f"{type(module).__name__} declares no _no_split_modules: cannot find its decoder layers"
        )
    return [m for m in module.modules() if type(m).__name__ in names]


def enable_gradient_checkpointing(hf_model: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward (HF's non-reentrant checkpointing; only active in
    train mode). Composes with FSDP2: its hooks skip re-gathering during the recompute."""
    hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(hf_model, "config"):
        hf_model.config.use_cache = False
