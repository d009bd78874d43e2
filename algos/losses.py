"""PPO losses: clipped policy surrogate (with dual clip), clipped value loss, entropy bonus.

Every loss is first computed per token as a (B, T) matrix, then reduced with :func:`agg_loss`
over the response positions (``response_mask`` = 1) in one of the ``LOSS_AGG_MODES``.
"""

from __future__ import annotations

import torch

from ppoflow.algos.logits import entropy_from_logits
from ppoflow.algos.masked import masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "weighted",
    "compute_policy_loss",
    "compute_value_loss",
    "compute_entropy_loss",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

LOG_RATIO_CLAMP = 20.0


def _mean_over_sequences(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence values (B,) over the sequences with at least one valid token."""
    has_tokens = (loss_mask != 0).any(dim=-1)
    return masked_mean(seq_values, has_tokens)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss matrix to a scalar.

    Modes:
        - ``token-mean``: mean over all valid tokens of the batch (long responses weigh more).
        - ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences.
        - ``seq-mean-token-mean``: mean over each sequence's tokens, mean over sequences.
        - ``seq-mean-token-sum-norm``: sum over each sequence's tokens divided by the padded
          response length T (a constant, as in Dr. GRPO), mean over sequences.

    "Mean over sequences" counts the sequences that have at least one valid token; rows whose mask
    is all 0 are left out. A batch without any valid token gives 0.

    Args:
        loss_mat: (B, T) per-token loss.
        loss_mask: (B, T) 1 on tokens that count.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Returns:
        scalar tensor.
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return _mean_over_sequences(masked_sum(loss_mat, loss_mask, dim=-1), loss_mask)
    if loss_agg_mode == "seq-mean-token-mean":
        return _mean_over_sequences(masked_mean(loss_mat, loss_mask, dim=-1), loss_mask)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        seq_sums = masked_sum(loss_mat, loss_mask, dim=-1) / loss_mask.shape[-1]
        return _mean_over_sequences(seq_sums, loss_mask)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}")


def weighted(loss_mat: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """``loss_mat`` (B, T) times the rollout correction's (B, T) importance weights, detached
    (the weights are constants of the update); ``loss_mat`` itself when there are none."""
    if rollout_is_weights is None:
        return loss_mat
    return loss_mat * rollout_is_weights.detach().to(loss_mat.dtype)


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate objective with asymmetric clip and dual clip.

    Per token, with ``ratio = exp(clamp(log_prob - old_log_prob, -20, 20))``:

    - ``clipped = max(-A * ratio, -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))``
      (Schulman et al., 2017; asymmetric bounds as in DAPO's clip-higher);
    - for ``A < 0`` the loss is further bounded above: ``min(clipped, -A * clip_ratio_c)``
      (dual clip, Ye et al., 2020), so a huge ratio on a bad action cannot blow the loss up;
    - for ``A >= 0`` the loss is ``clipped``.

    Args:
        old_log_prob: (B, T) log-probs of the sampled tokens under the behaviour policy.
        log_prob: (B, T) log-probs under the current policy (carries the gradient).
        advantages: (B, T).
        response_mask: (B, T) 1 on response tokens.
        clip_ratio_low: lower clip, the ratio is clipped at ``1 - clip_ratio_low``.
        clip_ratio_high: upper clip, the ratio is clipped at ``1 + clip_ratio_high``.
        clip_ratio_c: dual-clip constant, must be > 1.
        loss_agg_mode: see :func:`agg_loss`.
        rollout_is_weights: (B, T) importance weights of the rollout correction
            (``ppoflow.algos.correction``), no gradient; each token's loss is multiplied by its
            weight before aggregation. None: 1.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``, all scalars:
        the aggregated loss; the fraction of response tokens where the clipped term is the larger
        (the clip is active); the mean of ``old_log_prob - log_prob`` (k1 estimate of
        KL(old || new), on the clamped log-ratio); the fraction of tokens with ``A < 0`` where
        the dual-clip bound is active.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped_losses = -advantages * ratio
    clipped_losses = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = torch.maximum(unclipped_losses, clipped_losses)
    pg_clipfrac = masked_mean((clipped_losses > unclipped_losses).to(ratio.dtype), response_mask)

    dual_bound = -advantages * clip_ratio_c
    dual_clip_losses = torch.minimum(clip_losses, dual_bound)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(((clip_losses > dual_bound) & negative).to(ratio.dtype), response_mask)

    pg_losses = torch.where(negative, dual_clip_losses, clip_losses)
    pg_loss = agg_loss(weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 style).

    ``vf_loss = 0.5 * agg(max((vpreds - returns)^2, (clip(vpreds, values - c, values + c) - returns)^2))``

    Args:
        vpreds: (B, T) current critic predictions (carries the gradient).
        returns: (B, T) targets (GAE returns).
        values: (B, T) critic predictions at rollout time, the centre of the clip.
        response_mask: (B, T) 1 on response tokens.
        cliprange_value: clip half-width ``c``; ``None`` disables clipping.
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``, scalars; ``vf_clipfrac`` is the fraction of response tokens
        where the clipped error is larger than the unclipped one.
    """
    unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        clipped = unclipped
    else:
        vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(unclipped, clipped)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((clipped > unclipped).to(vf_losses.dtype), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated entropy of the policy over the response tokens.

    Args:
        logits: (B, T, V).
        response_mask: (B, T).
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        scalar tensor: the mean entropy (subtract ``coef * entropy`` from the loss as a bonus).
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
