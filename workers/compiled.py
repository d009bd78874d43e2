"""``torch.compile`` for the models the workers train (``model.use_torch_compile``).

What it buys on a GPU: the elementwise work around the matmuls (RMSNorm's float32 round trip,
rotary embeddings, SiLU x up, residual adds) and the LM head's softmax math run as a few fused
kernels instead of dozens of memory passes, which bound a small model's update once its matmuls
are fast (docs/benchmarks.md: the actor's update and MFU). The LM head's part lives in
``ppoflow.workers.lm_head`` (``compiled=True``).
"""

from __future__ import annotations

import torch
from torch import nn

from ppoflow.workers.hf_models import decoder_layers

__all__ = ["compile_decoder_layers"]


def compile_decoder_layers(hf_model: nn.Module, layers: list[nn.Module] | None = None) -> None:
    """``torch.compile`` each decoder layer's ``forward`` (dynamic shapes: packed micro-batches vary
    in length); ``layers`` default: the classes in the model's ``_no_split_modules``.

    The module, its hooks and parameter names stay as they are, so FSDP2 wraps it and checkpoints
    keep their HF names. The ``ppoflow_varlen`` attention runs eagerly between two compiled graphs;
    generation with a KV cache keeps the eager forward. All layers share one compiled graph (same
    code, parameters as inputs); every further model in the process (the reference beside the
    actor) and every input kind (packed or padded, with or without gradients) adds an entry to
    that code's cache, so the per-code recompile limit is raised from torch's 8 (past it, layers
    silently run eager).
    """
    import torch._dynamo.config as dynamo_config

    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))
    for layer in decoder_layers(hf_model) if layers is None else layers:
        layer.forward = _without_cache_only(layer.forward, torch.compile(layer.forward, dynamic=True))


def _without_cache_only(eager, compiled):
    """The compiled forward for training and scoring passes; the eager one for generation with a
    KV cache (``rollout.engine: hf``), whose cache object and one-token steps would only make the
    compiled graph recompile or break."""

    def forward(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return forward
