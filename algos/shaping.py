"""DAPO's data-side tricks as pure functions (Yu et al., 2025).

- :func:`overlong_penalty`: the soft length penalty in a buffer before the maximum response length
  (overlong reward shaping);
- :func:`truncated_rows`: responses cut at the maximum length (overlong filtering masks them out of
  the loss);
- :func:`informative_groups`: which prompt groups have rewards that differ (dynamic sampling keeps
  those; a group whose responses all scored the same has zero advantage under GRPO: no gradient).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["overlong_penalty", "truncated_rows", "informative_groups"]


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment of each response, (B,) float32 (<= 0).

    With ``L_max = max_length`` and ``L_cache = buffer_length``:
    0 for ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` inside the buffer
    (linear from 0 to -1); -1 beyond ``L_max`` (cannot happen here: responses stop at ``L_max``).
    Multiplied by ``penalty_factor``.

    Args:
        lengths: (B,) response lengths in tokens.
        max_length: the maximum response length (``rollout.response_length``).
        buffer_length: the buffer's length, ``0 < buffer_length <= max_length``.
        penalty_factor: scale of the penalty.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, {max_length}], got {buffer_length}")
    start = max_length - buffer_length
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -(over / buffer_length).clamp(max=1.0) * penalty_factor


def truncated_rows(
    response_mask: torch.Tensor, max_length: int, ended_by_budget: torch.Tensor | None = None
) -> torch.Tensor:
    """(B,) bool: responses that used all ``max_length`` tokens (cut by the length limit, not
    ended by the model), as ``response_length/clip_ratio`` counts them.

    A multi-turn episode's budget counts the environment's tokens too: pass the mask of the whole
    episode (the response part of ``attention_mask``), not the policy-token ``response_mask``, or an
    episode cut at the budget after environment turns is never flagged. ``ended_by_budget`` (B,)
    flags the episodes the budget ended before it was full (the environment's next answer did not
    fit: ``budget_ended`` of a multi-turn rollout); they count as cut too.
    """
    cut = response_mask.sum(-1) >= max_length
    return cut if ended_by_budget is None else cut | (ended_by_budget != 0)


def informative_groups(scores: Any, index: Any) -> np.ndarray:
    """(B,) bool: the rows whose group (same entry of ``index``) has at least two different scores.

    Args:
        scores: (B,) the outcome score of each response.
        index: (B,) group labels (the prompt each response answers).
    """
    values = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(index)
    keep = np.zeros(len(labels), dtype=bool)
    for label in dict.fromkeys(labels.tolist()):
        rows = labels == label
        group = values[rows]
        keep[rows] = bool(group.max() != group.min())
    return keep
