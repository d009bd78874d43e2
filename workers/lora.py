"""LoRA adapters (PEFT) on the FSDP models: injected before sharding, trained alone, switched off
for the reference policy, read back whole for the rollout engine and for export.

    wrap = with_adapters(functools.partial(PolicyLM, ...), cfg.actor.lora)   # build_fsdp_model's wrap
    module = build_fsdp_model(cfg.model, "causal_lm", wrap, mesh, fsdp_cfg, device)
    with adapters_off(module): ...                    # the base model: the reference policy
    tensors = adapter_tensors(module)                 # PEFT names, full tensors (collective)
    for name, w in merged_weights(module): ...        # HF names, W + (alpha/r) B A (collective)

PEFT (``get_peft_model``) replaces each targeted ``nn.Linear`` of the HF model in place by a LoRA
layer holding the frozen base linear (``...q_proj.base_layer.weight``) and the trainable
``lora_A`` / ``lora_B`` (``...q_proj.lora_A.default.weight``). The wrapper (``PolicyLM`` /
``ValueModel``) registers the same modules, so its parameter names are these names. Everything
else of the base model is frozen (no gradients, no optimizer state); a critic's value head stays
trained. ``lora_B`` starts at zero: the model starts as the base model.

Checkpoints keep the trainable parameters only: the module carries ``checkpoint_trainable_only``,
which ``ppoflow.infra.checkpoint.state`` reads (the base comes from ``model.path`` again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ppoflow.infra.checkpoint.lora_export import ADAPTER, peft_config, peft_name, write_adapter_dir
from ppoflow.workers.fsdp_utils import full_param, hf_name, reshard_all

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ppoflow.infra.config import LoRAConfig

__all__ = [
    "ADAPTER",
    "peft_config",
    "with_adapters",
    "has_adapters",
    "lora_config_of",
    "adapters_off",
    "adapter_tensors",
    "merged_weights",
    "write_adapter_dir",
    "peft_name",
]

M = TypeVar("M", bound=nn.Module)


def _head_names(hf_model: PreTrainedModel) -> list[str]:
    """The token-classification heads of a critic / reward model (trained whole, no adapter)."""
    return [n for n in ("score", "classifier") if isinstance(getattr(hf_model, n, None), nn.Module)]


def add_adapters(hf_model: PreTrainedModel, cfg: LoRAConfig) -> PreTrainedModel:
    """Inject LoRA layers into ``hf_model`` in place (PEFT) and return it: base frozen, adapters
    trainable, a token-classification head (critic) trainable. On a model built on the meta device
    the adapters are made there too (FSDP materialises them with the rest)."""
    from peft import get_peft_model

    heads = _head_names(hf_model)
    on_meta = any(p.is_meta for p in hf_model.parameters())
    peft_model = get_peft_model(
        hf_model, peft_config(cfg, exclude=heads), autocast_adapter_dtype=True, low_cpu_mem_usage=on_meta
    )
    model = peft_model.base_model.model  # the same object, now with LoRA layers
    for head in heads:
        getattr(model, head).requires_grad_(True)
    object.__setattr__(model, "ppoflow_peft", peft_model)  # unregistered: for disable_adapter()
    return model


def with_adapters(
    wrap: Callable[[PreTrainedModel], M], cfg: LoRAConfig | None
) -> Callable[[PreTrainedModel], M]:
    """``wrap`` (e.g. ``PolicyLM``) applied after :func:`add_adapters` when ``cfg`` turns LoRA on;
    ``wrap`` itself otherwise. The wrapped module saves only its trainable parameters."""
    if cfg is None or not cfg.enabled:
        return wrap

    def wrap_with_adapters(hf_model: PreTrainedModel) -> M:
        module = wrap(add_adapters(hf_model, cfg))
        object.__setattr__(module, "checkpoint_trainable_only", True)  # ppoflow.infra.checkpoint.state
        object.__setattr__(module, "lora_config", cfg)
        return module

    return wrap_with_adapters


def has_adapters(module: nn.Module) -> bool:
    """True for a module built by :func:`with_adapters` with LoRA on."""
    return lora_config_of(module) is not None


def lora_config_of(module: nn.Module) -> LoRAConfig | None:
    """The ``LoRAConfig`` a module was built with by :func:`with_adapters` (None: no adapters)."""
    return getattr(module, "lora_config", None)


def _peft_model(module: nn.Module) -> Any:
    hf = getattr(module, "hf_model", None)
    peft_model = getattr(hf, "ppoflow_peft", None)
    if peft_model is None:
        raise ValueError(f"{type(module).__name__} carries no LoRA adapters")
    return peft_model


@contextlib.contextmanager
def adapters_off(module: nn.Module) -> Iterator[None]:
    """The base model for the block (PEFT's ``disable_adapter``): the reference policy, without a
    second copy of the weights. PEFT marks disabled adapters frozen; their ``requires_grad`` is put
    back at once (FSDP2 reads it when it first initialises, which may happen inside the block)."""
    grads = {p: p.requires_grad for p in module.parameters()}
    with _peft_model(module).disable_adapter():
        for p, flag in grads.items():
            p.requires_grad_(flag)
        yield


def _lora_layers(module: nn.Module) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer

    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            yield hf_name(name), sub


def adapter_tensors(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full ``lora_A`` / ``lora_B`` tensors by PEFT name, on the CPU (``dtype``: cast).

    Collective across the FSDP mesh: every rank must call it (the same order everywhere)."""
    reshard_all(module)
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            full = full_param(param).cpu()
            out[peft_name(hf_name(name))] = full if dtype is None else full.to(dtype)
    if not out:
        raise ValueError("the module has no LoRA parameters (lora.rank 0?)")
    return out


def merged_weights(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` of the model with its adapters merged, one tensor at a time:
    ``W + (alpha / r) * B @ A`` for each adapted linear (under the base model's names, without
    ``base_layer``), every other parameter as it is. Collective like ``iter_full_params``."""
    reshard_all(module)
    layers = dict(_lora_layers(module))
    params = dict(module.named_parameters())
    for name, param in params.items():
        clean = hf_name(name)
        if ".lora_A." in clean or ".lora_B." in clean:
            continue  # folded into their base weight below
        full = full_param(param)
        owner, _, leaf = clean.rpartition(".base_layer.")
        if owner and leaf == "weight":
            layer: Any = layers[owner]
            a = full_param(params[_param_of(name, "lora_A")])
            b = full_param(params[_param_of(name, "lora_B")])
            full = (full.float() + layer.scaling[ADAPTER] * (b.float() @ a.float())).to(full.dtype)
        if owner:
            clean = f"{owner}.{leaf}"
        yield clean, (full if dtype is None else full.to(dtype))


def _param_of(base_weight_name: str, which: str) -> str:
    """``...q_proj.base_layer.weight`` -> ``...q_proj.lora_A.default.weight`` (same wrappers)."""
    return base_weight_name.replace(".base_layer.weight", f".{which}.{ADAPTER}.weight")
