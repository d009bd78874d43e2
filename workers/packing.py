"""Padding-free forwards: the real tokens of a micro-batch packed into one row, attention kept
inside each sequence, and micro-batches formed by a token budget instead of a row count.

A rollout row is ``[left-padded prompt | right-padded response]``; a padded forward spends the
attention and MLP FLOPs of every pad. Packing removes them:

    packed = pack(input_ids, attention_mask, position_ids)      # (1, T) ids/positions, T = real tokens
    hidden = packed_hidden(base, packed)                        # (T, H): base model on the packed row
    hidden[packed.index[b, j]]                                  # the state of token j of row b

Attention. The HF model runs with the attention implementation ``ppoflow_varlen``
(``use_varlen_attention(hf_model)``, from ``ppoflow.workers.attention``, which computes it): with
``cu_seq_lens_q``/``cu_seq_lens_k`` (what ``packed_hidden`` passes) each query attends only to the
earlier tokens of its own sequence, within the layer's sliding window and with its sinks; without
them (a padded forward, ``generate``) it computes what transformers' ``sdpa`` computes.

Micro-batches. ``token_budget_micro_batches`` groups rows so that each micro-batch holds at most
``budget`` real tokens (first-fit decreasing), then splits the largest groups until every rank
has the same count: FSDP's collectives need the same number of forwards on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ppoflow.workers.attention import (
    VARLEN_ATTENTION,
    packed_attention,
    use_varlen_attention,
    varlen_attention_forward,
)

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
