"""The trainer's tensors in the form vLLM's weight loaders take, and what a push must fix after
vLLM's in-place reload.

    fmt = EngineFormat(hf_model)                      # the trained model (PolicyLM or HF), once
    stream = fmt.stream(live_weights(module))         # checkpoint names and layouts, per layer
    rollout.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, ...})
    rollout.collective_rpc(after_reload, kwargs={"direct": fmt.held})   # tied heads, experts, sinks

Names and layouts. transformers 5 trains some models in another layout than their checkpoints
store: Qwen3-MoE's (and Qwen3-Next's) experts are one 3-D ``mlp.experts.gate_up_proj`` /
``down_proj`` tensor per layer at run time and ``mlp.experts.<e>.gate_proj.weight`` ... on disk.
The FSDP module's parameter names are the run-time ones; vLLM's loaders know the checkpoint's and
silently skip the others (the engine keeps its old experts: log-probs off by ~0.5 after one
update). :meth:`EngineFormat.stream` applies transformers' own reverse conversion (what
``save_pretrained`` writes) to each decoder layer's tensors together. Models whose run-time and
checkpoint layouts agree pass through unchanged.

GPT-OSS. Its checkpoint layout is the run-time one, but vLLM's loader copies the fused experts and
the attention sinks straight into their parameters, which vLLM's in-place reload (the CPU build's
push) has moved to the meta device: the copies vanish and the engine keeps the old experts and
sinks. For that reload (``split_experts``) the stream gives the experts one by one
(``mlp.experts.<e>.gate_up_proj``, ...: the per-expert path of newer vLLM loaders, through weight
loaders that reload records). A push that calls the live model's ``load_weights`` (the GPU build)
gives them fused, the checkpoint's layout, which the GPU build's loader takes (it has no
per-expert path). Either way the sinks are held back; :func:`after_reload`
copies them into the engine's parameters (this TP rank's heads) once the load is done. Qwen3-Next's
delta-net convolution weights are held back too (their loader fails on the reload's meta tensors
with tensor parallelism) and loaded after it through their own loader.

After the reload (vLLM's CPU build), :func:`after_reload` re-packs what the reload leaves stale:
the tied LM head (:func:`refresh_tied_layers`), and every fused-expert layer: on a weight
update vLLM's unquantized MoE method copies the checkpoint-layout tensors into the kernel's
storage and skips the CPU kernel's pre-packing (its ``process_weights_after_loading`` runs only
at the first load), so the experts compute with unpacked weights read as packed ones (log-probs
off by ~0.04 even when the weights did not change). A push is always the whole model, so every
fused-expert layer was reloaded and is packed again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["EngineFormat", "after_reload", "refresh_tied_layers"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")
#: GPT-OSS's fused expert tensors (E, ...) given to vLLM one expert at a time.
_GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
#: Tensors vLLM's in-place reload cannot take, by model type (name suffixes): loaded after it
#: (:func:`after_reload`). GPT-OSS's sinks (copied straight into a parameter the reload moved to meta).
_HELD = {"gpt_oss": (".sinks",)}


class EngineFormat:
    """The conversion of one model's tensors (see the module docstring).

    Args:
        model: the trained model: a ``PolicyLM`` (its ``hf_model`` is used) or a Hugging Face model
            (FSDP-sharded or on the meta device: only its classes and config are read).
        split_experts: give GPT-OSS's fused expert tensors one expert at a time (vLLM's in-place
            ``reload_weights``, the CPU build's push); False: fused, as on disk (``load_weights``).
    """

    def __init__(self, model: nn.Module, split_experts: bool = True):
        hf: Any = getattr(model, "hf_model", model)
        self.model = hf
        self.split_experts = split_experts
        self.model_type = getattr(getattr(hf, "config", None), "model_type", None)
        self.converts = _has_conversions(hf)
        self.held: dict[str, torch.Tensor] = {}

    def stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` in the checkpoint's names and layouts (GPT-OSS: experts one by one
        where ``split_experts``, sinks held back in :attr:`held`). Buffers one decoder layer at a
        time when converting."""
        self.held = {}
        source = _by_layer(weights) if self.converts else ([item] for item in weights)
        for group in source:
            items = self._reverted(group) if self.converts else group
            for name, tensor in items:
                yield from self._engine_items(name, tensor)

    def _reverted(self, group: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(self.model, dict(group)).items())

    def _engine_items(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(_HELD.get(self.model_type or "", ())):
            self.held[name] = tensor
            return
        owner, _, leaf = name.rpartition(".")
        if (
            self.split_experts
            and self.model_type == "gpt_oss"
            and owner.endswith(".mlp.experts")
            and leaf in _GPT_OSS_EXPERTS
        ):
            for expert in range(tensor.shape[0]):
                yield f"{owner}.{expert}.{leaf}", tensor[expert]
        else:
            yield name, tensor


def _has_conversions(hf: Any) -> bool:
    """Whether transformers converts this model's checkpoint layout at load (and back at save)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    try:
        conversions = getattr(hf, "_weight_conversions", None) or get_model_conversion_mapping(
            hf, add_legacy=False
        )
    except Exception:  # noqa: BLE001 - a model transformers cannot describe converts nothing
        return False
    return any(isinstance(c, WeightConverter) for c in conversions or [])


def _by_layer(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one decoder layer together (the trainer yields a layer's parameters
    one after another); every other tensor alone."""
    group: list[tuple[str, torch.Tensor]] = []
    current: int | None = None
    for name, tensor in weights:
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m else None
        if group and (layer is None or layer != current):
            yield group
            group = []
        current = layer
        group.append((name, tensor))
        if layer is None:
            yield group
            group = []
    if group:
        yield group


def _refresh_experts(model: nn.Module) -> list[str]:
    """Pack the CPU fused-expert kernels' weights again (see the module docstring)."""
    refreshed = []
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(mod, "w13_weight"):
            experts.process_weights_after_loading(mod)
            refreshed.append(name)
    return refreshed


@torch.no_grad()
def _copy_direct(model: nn.Module, direct: dict[str, torch.Tensor]) -> list[str]:
    """Load held tensors into the engine's live parameters: GPT-OSS's sinks copied (this TP rank's
    heads), anything else through the parameter's own weight loader (which takes this TP rank's
    share of the full tensor)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    done = []
    for name, tensor in direct.items():
        target = name if name in params else name.replace(".self_attn.", ".attn.")
        if target not in params:
            raise KeyError(f"the engine has no parameter {target} for the pushed tensor {name}")
        param = params[target]
        if name.endswith(".sinks"):  # a plain parameter: vLLM's loader narrows it by hand too
            share = tensor.shape[0] // tp
            param.data.copy_(tensor[rank * share : (rank + 1) * share])
        else:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype))
        done.append(target)
    return done


def refresh_tied_layers(worker: Any) -> list[str]:
    """vLLM worker RPC: re-run ``process_weights_after_loading`` of unquantized layers that share
    their weight with another layer (the tied LM head), so CPU pre-packed GEMM handles see the new
    weights. Returns the names of the refreshed modules. No-op off the CPU backend."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    model = worker.model_runner.get_model()
    by_storage: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        method = getattr(mod, "quant_method", None)
        if method is None or not isinstance(weight, torch.Tensor) or weight.numel() == 0 or weight.is_meta:
            continue
        by_storage.setdefault(weight.untyped_storage().data_ptr(), []).append((name, mod))
    refreshed = []
    for members in by_storage.values():
        if len(members) < 2:
            continue
        for name, mod in members:
            if isinstance(mod.quant_method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                mod.quant_method.process_weights_after_loading(mod)
                refreshed.append(name)
    return refreshed


def after_reload(worker: Any, direct: dict[str, torch.Tensor] | None = None) -> dict[str, list[str]]:
    """vLLM worker RPC after a push: on the CPU build, re-pack the tied head and the fused experts;
    everywhere, copy the ``direct`` tensors (:attr:`EngineFormat.held`). Returns what it touched."""
    from vllm.platforms import current_platform

    model = worker.model_runner.get_model()
    out: dict[str, list[str]] = {"tied_refreshed": [], "experts_refreshed": [], "direct": []}
    if current_platform.is_cpu():
        out["tied_refreshed"] = refresh_tied_layers(worker)
        out["experts_refreshed"] = _refresh_experts(model)
    out["direct"] = _copy_direct(model, direct or {})
    return out
