"""Padding-free forwards: the real tokens of a micro-batch packed into one row, attention kept
inside each sequence, and micro-batches formed by a token budget instead of a row count.

A rollout row is ``[left-padded prompt | right-padded response]``; a padded forward spends the
attention and MLP FLOPs of every pad. Packing removes them:

    packed = pack(input_ids, attention_mask, position_ids)      # (1, T) ids/positions, T = real tokens
    hidden = packed_hidden(base, packed)                        # (T, H): base model on the packed row
    hidden[packed.index[b, j]]                                  # the state of token j of row b

Attention. The HF model runs with the attention implementation ``ppoflow_varlen``
(``use_varlen_attention(hf_model)``), registered in transformers' ``AttentionInterface``. With
``cu_seq_lens_q``/``cu_seq_lens_k`` (what ``packed_hidden`` passes) each query attends only to the
earlier tokens of its own sequence:
- on CUDA in bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen: no
  compute across sequences, no (T, T) mask);
- elsewhere (CPU, float32): ``scaled_dot_product_attention`` per sequence.
Without those kwargs (a padded forward, ``generate``) it is exactly transformers' ``sdpa``.
Why not ``sdpa`` with packed ``position_ids``: transformers then builds a dense (1, 1, T, T)
block-diagonal mask and computes attention across all T tokens (quadratic in the micro-batch's
tokens); and only with ``use_cache=False``. ``flash_attention_2`` needs the flash-attn package,
which ppoflow's GPU set-up does not install.

Micro-batches. ``token_budget_micro_batches`` groups rows so that each micro-batch holds at most
``budget`` real tokens (first-fit decreasing), then splits the largest groups until every rank
has the same count: FSDP's collectives need the same number of forwards on every rank.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "VARLEN_ATTENTION",
    "Packed",
    "pack",
    "packed_hidden",
    "checked_index",
    "use_varlen_attention",
    "varlen_attention_forward",
    "packed_attention",
    "first_fit_decreasing",
    "split_to_count",
    "token_budget_micro_batches",
]

VARLEN_ATTENTION = "ppoflow_varlen"


@dataclass(frozen=True)
class Packed:
    """The real tokens of a (B, L) batch in one row.

    Attributes:
        input_ids, position_ids: (1, T), T = number of real tokens, rows one after another.
        cu_seqlens: (B + 1,) int32 offsets of the rows in the packed row (on the batch's device).
        max_len: the longest row, in tokens.
        index: (B, L) long: where token (b, j) sits in the packed row; -1 for padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    index: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Packed:
    """Drop the padding of a (B, L) batch: its real tokens (``attention_mask`` != 0), row by row, in
    one (1, T) row with their own ``position_ids``. Each row is one sequence (its real tokens need
    not be contiguous: left and right padding both go)."""
    valid = attention_mask.bool()
    lengths = valid.sum(-1)
    flat = valid.flatten()
    index = torch.where(valid, flat.long().cumsum(0).view_as(valid) - 1, -1)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return Packed(
        input_ids=input_ids.flatten()[flat].unsqueeze(0),
        position_ids=position_ids.flatten()[flat].unsqueeze(0),
        cu_seqlens=cu,
        max_len=int(lengths.max()) if len(lengths) else 0,
        index=index,
    )


def packed_hidden(base: nn.Module, packed: Packed) -> torch.Tensor:
    """Final hidden states (T, H) of the HF base model on a packed row, each token attending only
    to its own sequence. The model must use ``VARLEN_ATTENTION`` (``use_varlen_attention``)."""
    impl = getattr(base.config, "_attn_implementation", None)
    if impl != VARLEN_ATTENTION:
        raise RuntimeError(
            f"a packed forward needs the model's attention implementation {VARLEN_ATTENTION!r}, "
            f"it has {impl!r}: call ppoflow.workers.packing.use_varlen_attention(hf_model) first"
        )
    out = base(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,
        use_cache=False,
        cu_seq_lens_q=packed.cu_seqlens,
        cu_seq_lens_k=packed.cu_seqlens,
        max_length_q=packed.max_len,
        max_length_k=packed.max_len,
    )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


def checked_index(idx: torch.Tensor, what: str) -> torch.Tensor:
    """``idx`` (packed-row indices picked from ``Packed.index``) unchanged; ValueError if one of them
    is a padding position (-1): a packed forward has no state there."""
    if idx.numel() and bool((idx < 0).any()):
        raise ValueError(
            f"packed forward: {what} is computed at a padding position (attention_mask 0 there), "
            "and a packed forward only has the states of real tokens. Fix the masks, or set "
            "use_dynamic_bsz=false for this model"
        )
    return idx


# ---------------------------------------------------------------------------- attention


@functools.lru_cache(maxsize=1)
def _varlen_kernel() -> tuple[Callable[..., Any], frozenset[str]] | None:
    """torch's FlashAttention varlen entry point and its keyword names (they changed between
    torch 2.9 and 2.12: ``is_causal`` became ``window_size``; ``enable_gqa`` arrived), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen(query, key, value, cu, max_len: int, scaling: float | None) -> torch.Tensor | None:
    """(T, Hq, D) causal varlen attention through torch's flash kernel, or None where it cannot run
    (CPU, float32, no kernel, a scale the kernel cannot take)."""
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
    if "is_causal" in params:
        kwargs["is_causal"] = True
    elif "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        return None
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return fn(query, key.contiguous(), value.contiguous(), cu, cu, max_len, max_len, **kwargs)


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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (``AttentionInterface``): query (B, Hq, T, D), key/value
    (B, Hkv, T, D) -> (B, T, Hq, D). Packed (``cu_seq_lens_q`` given, B = 1): causal attention
    inside each segment. Otherwise transformers' ``sdpa`` unchanged. ``ppoflow_sp`` (a
    ``ppoflow.workers.sequence_parallel.SequenceParallel``, passed through the model's forward):
    the row is this rank's slice of a packed row, attention runs Ulysses-style over the group."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise NotImplementedError("packed attention with different query and key segments")
    if sliding_window is not None:
        raise NotImplementedError(
            "packed attention with a sliding window is not supported: turn use_dynamic_bsz off "
            "for this model (or disable its sliding window)"
        )
    if dropout:
        raise NotImplementedError("packed attention with attention dropout (set attention_dropout=0)")
    if query.shape[0] != 1:
        raise ValueError(f"a packed attention call takes one packed row, got batch {query.shape[0]}")
    max_len = int(max_length_q or query.shape[2])
    if ppoflow_sp is not None:  # Ulysses: this rank's tokens, the whole row's segments
        return ppoflow_sp.attention(
            query, key, value, cu_seq_lens_q, max_len, scaling, packed_attention
        ), None
    return packed_attention(query, key, value, cu_seq_lens_q, max_len, scaling), None


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention inside each segment of one packed row: query (1, Hq, T, D), key/value
    (1, Hkv, T, D) -> (1, T, Hq, D). FlashAttention varlen where it runs (CUDA, bf16/fp16), else
    SDPA per segment."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = _flash_varlen(q.contiguous(), k, v, cu_seqlens, max_len, scaling)
    if out is not None:
        return out.unsqueeze(0)
    gqa = key.shape[1] != query.shape[1]
    bounds = cu_seqlens.tolist()
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e],
            key[:, :, s:e],
            value[:, :, s:e],
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


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
    through transformers' ``AttentionInterface`` or uses sliding-window layers."""
    _register()
    config = hf_model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError(
            f"{type(hf_model).__name__} uses sliding-window attention: packed forwards are not "
            "supported for it; set use_dynamic_bsz=false"
        )
    can_set = getattr(hf_model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise ValueError(
            f"{type(hf_model).__name__} does not dispatch attention through transformers' "
            "AttentionInterface: packed forwards are not supported for it; set use_dynamic_bsz=false"
        )
    hf_model.set_attn_implementation(VARLEN_ATTENTION)


# ---------------------------------------------------------------------------- micro-batches


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices grouped so that each group's lengths sum to at most ``budget``: longest rows
    first, each into the first group with room. Deterministic (ties keep row order); rows inside
    a group in increasing order. ValueError if a row alone exceeds the budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit the token budget {budget}")
        for g, free in enumerate(room):
            if lengths[i] <= free:
                groups[g].append(i)
                room[g] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(budget - lengths[i])
    return [sorted(g) for g in groups]


def split_to_count(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Split the groups holding the most tokens (of those with 2+ rows) in two until there are
    ``count``; a split never exceeds the budget the groups respected. ValueError if there are
    fewer rows than ``count``."""
    groups = [list(g) for g in groups]
    if sum(len(g) for g in groups) < count:
        raise ValueError(f"cannot form {count} micro-batches from {sum(len(g) for g in groups)} rows")
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        big = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        groups.remove(big)
        by_len = sorted(big, key=lambda i: (-lengths[i], i))
        halves: list[list[int]] = [[], []]
        sums = [0, 0]
        for i in by_len:  # greedy balance of the two halves
            h = 0 if sums[0] <= sums[1] else 1
            halves[h].append(i)
            sums[h] += lengths[i]
        groups.extend(sorted(h) for h in halves)
    return groups


def token_budget_micro_batches(
    lengths: torch.Tensor, budget: int, device: torch.device | str, field: str
) -> list[torch.Tensor]:
    """Micro-batches (row-index tensors) of at most ``budget`` real tokens each, the same number on
    every rank of the default process group (collective: all ranks must call it together).

    Args:
        lengths: (B,) real tokens per row (``attention_mask.sum(-1)``).
        field: the config field of the budget, named in the error when a row does not fit.
    """
    lens = [int(x) for x in lengths.tolist()]
    longest = max(lens, default=0)
    if longest > budget:
        raise ValueError(
            f"{field}={budget} is smaller than a sequence of {longest} tokens: set it to at least "
            "rollout.prompt_length + rollout.response_length"
        )
    groups = first_fit_decreasing(lens, budget)
    count = len(groups)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([count], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        count = int(t.item())
    groups = split_to_count(groups, lens, count)
    return [torch.tensor(g, dtype=torch.long) for g in groups]
