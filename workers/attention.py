"""The ``ppoflow_varlen`` attention of packed forwards: causal attention inside each sequence of a
packed row, with the sliding windows and attention sinks the models of the matrix use.

    use_varlen_attention(hf_model)    # the model dispatches attention here from now on
    packed_attention(q, k, v, cu_seqlens, max_len, scaling, sliding_window=w, sinks=s)

The HF model runs with the attention implementation ``ppoflow_varlen``, registered in transformers'
``AttentionInterface``. With ``cu_seq_lens_q``/``cu_seq_lens_k`` (what
``ppoflow.workers.packing.packed_hidden`` passes) each query attends only to the earlier tokens
of its own sequence:
- on CUDA in bf16/fp16 without sinks: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention
  varlen: no compute across sequences, no (T, T) mask; a window as its ``window_size``);
- elsewhere (CPU, float32, sinks): attention per sequence, ``scaled_dot_product_attention`` or,
  with sinks, the softmax over the scores and the sink written out.
Without those kwargs (a padded forward, ``generate``) it computes what transformers' ``sdpa``
computes from the same mask (which carries a layer's window); with attention sinks (GPT-OSS, whose
transformers class runs no ``sdpa``) the same softmax with the sink as its eager attention.

Windows. A layer with ``sliding_window`` w (transformers passes it to the attention function:
Mistral, Phi-3, Gemma 3's local layers, GPT-OSS's alternate layers) lets a query see itself and
the w - 1 tokens before it (transformers' ``kv_idx > q_idx - w``; FlashAttention's ``(w - 1, 0)``).
Sinks (GPT-OSS ``s_aux``): one learned logit per head that joins every query's softmax and takes
its share of the weight but carries no value.
Why not ``sdpa`` with packed ``position_ids``: transformers then builds a dense (1, 1, T, T)
block-diagonal mask and computes attention across all T tokens (quadratic in the micro-batch's
tokens); and only with ``use_cache=False``. ``flash_attention_2`` needs the flash-attn package,
which ppoflow's GPU set-up does not install.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "VARLEN_ATTENTION",
    "use_varlen_attention",
    "varlen_attention_forward",
    "packed_attention",
    "window_mask",
    "sink_attention",
]

VARLEN_ATTENTION = "ppoflow_varlen"


@functools.lru_cache(maxsize=1)
def _varlen_kernel() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's FlashAttention varlen entry point and its keyword names (they changed between
    torch 2.9 and 2.12: ``is_causal`` became ``window_size``; ``enable_gqa`` arrived), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(
    query, key, value, cu, max_len: int, scaling: float | None, window: int | None = None
) -> torch.Tensor | None:
    """(T, Hq, D) causal varlen attention through torch's flash kernel, or None where it cannot run
    (CPU, float32, no kernel, a scale or a window the kernel cannot take)."""
    kernel = _varlen_kernel()
    if kernel is None or not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    fn, params = kernel
    kwargs: dict = {}
    head_dim = query.shape[-1]
    if "scale" in params:
        kwargs["scale"] = scaling
    elif scaling is not None and abs(scaling - head_dim**-0.5) > 1e-12:
        return None
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif "is_causal" in params and window is None:
        kwargs["is_causal"] = True
    else:
        return None
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return fn(query, key.contiguous(), value.contiguous(), cu, cu, max_len, max_len, **kwargs)


def window_mask(length: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """(L, L) bool: query i sees key j when j <= i and, with a window w, i - j < w."""
    i = torch.arange(length, device=device)
    seen = i[None, :] <= i[:, None]
    if window is not None:
        seen &= i[None, :] > i[:, None] - window
    return seen


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with one sink logit per head: query (B, Hq, L, D), key/value (B, Hkv, L, D), bool
    ``mask`` broadcastable to (B, Hq, L, L) (True: attend), ``sinks`` (Hq,) -> (B, Hq, L, D). The
    softmax runs over the scores and the sink; the sink's share carries no value."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scaling: float | None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention inside each segment of one packed row: query (1, Hq, T, D), key/value
    (1, Hkv, T, D) -> (1, T, Hq, D); a ``sliding_window`` and ``sinks`` (Hq,) as in the module
    docstring. FlashAttention varlen where it runs, else attention per segment."""
    if sinks is None:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
        out = _flash_varlen(q.contiguous(), k, v, cu_seqlens, max_len, scaling, sliding_window)
        if out is not None:
            return out.unsqueeze(0)
    gqa = key.shape[1] != query.shape[1]
    bounds = cu_seqlens.tolist()
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e <= s:
            continue
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if sinks is not None:
            parts.append(
                sink_attention(q, k, v, window_mask(e - s, sliding_window, q.device), scaling, sinks)
            )
        elif sliding_window is not None and e - s > sliding_window:
            mask = window_mask(e - s, sliding_window, q.device)
            parts.append(
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
            )
        else:
            parts.append(
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            )
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _padded(module, query, key, value, attention_mask, dropout, scaling, sliding_window, sinks, kwargs):
    """A padded call: transformers' ``sdpa`` from its mask; with sinks, :func:`sink_attention` on
    the same mask (bool, or None for plain causal: then built here, with the layer's window)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sinks is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise NotImplementedError("attention sinks with attention dropout (set attention_dropout=0)")
    mask = attention_mask
    if mask is None:
        mask = window_mask(query.shape[2], sliding_window, query.device)
    elif mask.dtype != torch.bool:
        mask = mask == 0  # an additive mask: 0 where attended
    return sink_attention(query, key, value, mask, scaling, sinks).transpose(1, 2).contiguous(), None


@torch.compiler.disable  # a graph break in a compiled decoder layer: this stays eager (data-dependent)
def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    ppoflow_sp: Any = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``): query (B, Hq, T, D), key/value
    (B, Hkv, T, D) -> (B, T, Hq, D). Packed (``cu_seq_lens_q`` given, B = 1): causal attention
    inside each segment, with the layer's ``sliding_window`` and sinks (``s_aux``). Otherwise what
    transformers' ``sdpa`` computes (module docstring). ``ppoflow_sp`` (a
    ``ppoflow.workers.sequence_parallel.SequenceParallel``, passed through the model's forward):
    the row is this rank's slice of a packed row, attention runs Ulysses-style over the group."""
    if cu_seq_lens_q is None:
        return _padded(
            module, query, key, value, attention_mask, dropout, scaling, sliding_window, s_aux, kwargs
        )
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise NotImplementedError("packed attention with different query and key segments")
    if dropout:
        raise NotImplementedError("packed attention with attention dropout (set attention_dropout=0)")
    if query.shape[0] != 1:
        raise ValueError(f"a packed attention call takes one packed row, got batch {query.shape[0]}")
    max_len = int(max_length_q or query.shape[2])
    core = functools.partial(packed_attention, sliding_window=sliding_window)
    if ppoflow_sp is not None:  # Ulysses: this rank's tokens, the whole row's segments
        return ppoflow_sp.attention(
            query, key, value, cu_seq_lens_q, max_len, scaling, core, sinks=s_aux
        ), None
    return core(query, key, value, cu_seq_lens_q, max_len, scaling, sinks=s_aux), None


def _register() -> None:
    """Register ``VARLEN_ATTENTION`` with transformers: the attention function, and as its mask
    function sdpa's (a padded call gets the same mask as ``sdpa``) except that no mask is built
    when there is no 2-D attention mask (a packed row: the segments are the mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if VARLEN_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS:
        return

    def mask(*, attention_mask=None, **kwargs):  # transformers passes every argument by keyword
        if attention_mask is None:
            return None
        return sdpa_mask(attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, mask)


def use_varlen_attention(hf_model: PreTrainedModel) -> None:
    """Switch an HF model to ``VARLEN_ATTENTION`` (packed forwards become possible; padded ones
    compute what ``sdpa`` computes). ValueError for a model that does not dispatch its attention
    through transformers' ``AttentionInterface`` or has layers that are not attention (a hybrid
    model's linear-attention layers take no sequence boundaries)."""
    from ppoflow.infra.architectures.check import hybrid_layers

    _register()
    hybrid = hybrid_layers({"layer_types": getattr(hf_model.config, "layer_types", None)})
    if hybrid:
        raise ValueError(
            f"{type(hf_model).__name__} has {', '.join(hybrid)} layers, which transformers runs without "
            "sequence boundaries: packed forwards would mix the sequences of a micro-batch; set "
            "use_dynamic_bsz=false for this model"
        )
    can_set = getattr(hf_model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise ValueError(
            f"{type(hf_model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface: packed forwards are not supported for it; set use_dynamic_bsz=false"
        )
    hf_model.set_attn_implementation(VARLEN_ATTENTION)
