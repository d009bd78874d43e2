"""Token log-probabilities and entropies from language-model logits.

Logits are (B, T, V): batch, time, vocabulary. The vocabulary axis is the large one (10^5 for
real models), so both functions avoid materialising a full (B, T, V) ``log_softmax`` in float32
when they can.
"""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits", "logprobs_from_logits"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution ``softmax(logits)`` along the last axis.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, which never takes the log of a probability
    and so stays finite for peaked distributions. Logits of ``-inf`` (masked vocabulary entries)
    contribute 0.

    Args:
        logits: (B, T, V) or (..., V).

    Returns:
        (B, T) (the input shape without its last axis), same dtype as ``logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    weighted = torch.where(probs > 0, probs * logits, 0.0)
    return torch.logsumexp(logits, dim=-1) - weighted.sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under ``log_softmax(logits)``.

    For float32/float64 this is ``logits[label] - logsumexp(logits)``: one gather and one
    reduction, no (B, T, V) log-softmax tensor. For float16/bfloat16 the log-softmax is computed
    one row at a time in float32 (accurate, and only (T, V) float32 at a time), then cast back.

    Args:
        logits: (B, T, V) or (..., V).
        labels: (B, T) (the shape of ``logits`` without its last axis), integer token ids.

    Returns:
        (B, T), dtype of ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match")
    index = labels.long().unsqueeze(-1)
    if logits.dtype not in _LOW_PRECISION:
        picked = logits.gather(-1, index).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    if logits.dim() < 2:
        rows_logits, rows_index = logits.unsqueeze(0), index.unsqueeze(0)
    else:
        rows_logits, rows_index = logits, index
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, row_index).squeeze(-1)
        for row, row_index in zip(rows_logits, rows_index)
    ]
    out = torch.stack(rows).to(logits.dtype)
    return out.reshape(labels.shape)
