"""Rollout correction: importance weights and rejection masks between the sampler and the trainer.

The tokens of a batch were drawn by the rollout engine's policy ``mu`` (the *sampler*); the PPO
update treats them as drawn by the trainer's ``pi_old`` (the *proximal* policy: the FSDP actor's
recompute, ``old_log_probs``). Decoupled PPO (Hilton et al., 2021) keeps both: the clipped ratio
``pi_theta / pi_old`` keeps the update in its trust region, and an importance weight
``rho = pi_old / mu`` per token corrects for the data coming from ``mu``. With
``d_t = log pi_old(y_t) - log mu(y_t)`` (clamped to +-20 before ``exp``), two families, which compose:

Truncated importance sampling, TIS (Yao et al., 2025, "Your efficient RL framework secretly
brings you off-policy RL training"; Ionides, 2008) multiplies each token's policy loss by a weight
capped at ``cap`` (the variance stays bounded, the bias is the mass above the cap):

- ``token``:    ``w_t = min(exp(d_t), cap)``;
- ``sequence``: ``w_i = min(exp(sum_t d_t), cap)`` on every token of sequence i (the true
  importance ratio of the sequence, truncated).

Masked importance sampling / rejection, MIS (Liu, Li et al., 2025, "When speed kills stability")
and IcePop (Ling team, 2025) drop the tokens or sequences whose ratio leaves ``[lower, upper]``
from the actor's loss instead of down-weighting them (a sample the trainer would almost never draw
is noise, whatever its weight):

- ``token``:     keep token t iff ``lower <= exp(d_t) <= upper``;
- ``sequence``:  keep sequence i iff ``lower <= exp(sum_t d_t) <= upper``;
- ``geometric``: keep sequence i iff ``lower <= exp(mean_t d_t) <= upper`` (the per-token
  geometric mean: independent of the length, so its bounds sit close to 1, e.g. [0.999, 1.001]).

IcePop's objective is TIS ``token`` with MIS ``token`` at [0.5, 2] and a cap >= 2: the kept tokens
keep their weight ``r``. The weights and the mask carry no gradient (``pi_old`` and ``mu`` are
both fixed before the update); the loss multiplies its per-token term by ``w`` before aggregating
(``ppoflow.algos.policy_losses``), and the actor drops the rejected tokens from its response mask
(they count nowhere: neither in the loss nor in its normalisation). With every ratio 1 the weights
are 1 and nothing is masked: the update is exactly the uncorrected one.
"""

from __future__ import annotations

import torch

__all__ = [
    "TIS_LEVELS",
    "MIS_LEVELS",
    "truncated_is_weights",
    "rejection_mask",
    "correction_metrics",
]

TIS_LEVELS = ("token", "sequence")
MIS_LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_CLAMP = 20.0


def _log_ratios(
    trainer_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) ``d_t`` (0 off the mask, no gradient, float64) and the (B, R) float64 0/1 mask."""
    if trainer_log_probs.shape != sampler_log_probs.shape or trainer_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_log_probs.shape)}, sampler "
            f"{tuple(sampler_log_probs.shape)}, mask {tuple(response_mask.shape)}"
        )
    valid = response_mask != 0
    d = trainer_log_probs.detach().to(torch.float64) - sampler_log_probs.detach().to(torch.float64)
    return torch.where(valid, d, 0.0), valid.to(torch.float64)


def _level_log_ratio(d: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(B, R) the log-ratio each token is judged by at ``level``, clamped to +-20."""
    if level == "token":
        out = d
    elif level == "sequence":
        out = d.sum(-1, keepdim=True).expand_as(d)
    elif level == "geometric":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        out = (d.sum(-1, keepdim=True) / lengths).expand_as(d)
    else:
        raise ValueError(f"unknown level {level!r}; allowed: {', '.join(MIS_LEVELS)}")
    return out.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def truncated_is_weights(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    cap: float,
) -> torch.Tensor:
    """TIS weights (module docstring).

    Args:
        trainer_log_probs: (B, R) ``log pi_old`` of the sampled tokens (the trainer's recompute).
        sampler_log_probs: (B, R) ``log mu`` of the same tokens (the engine's).
        response_mask: (B, R) 1 on response tokens; rows may be ragged or empty.
        level: ``token`` or ``sequence``.
        cap: the truncation ``C`` > 0 (1 and above in practice; TIS's paper uses 2).

    Returns:
        (B, R) float32 weights, detached; 0 off the response mask.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown truncated IS level {level!r}; allowed: {', '.join(TIS_LEVELS)}")
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    d, mask = _log_ratios(trainer_log_probs, sampler_log_probs, response_mask)
    weights = torch.exp(_level_log_ratio(d, mask, level)).clamp(max=cap)
    return torch.where(mask != 0, weights, 0.0).to(torch.float32)


def rejection_mask(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    lower: float,
    upper: float,
) -> torch.Tensor:
    """MIS / rejection: which response tokens the actor keeps (module docstring).

    Args:
        trainer_log_probs, sampler_log_probs, response_mask: (B, R), as in :func:`truncated_is_weights`.
        level: ``token``, ``sequence`` or ``geometric``.
        lower, upper: the kept ratio band, ``0 < lower <= 1 <= upper`` (a ratio of 1, perfect
            agreement, is always kept).

    Returns:
        (B, R) 0/1 mask of ``response_mask``'s dtype: ``response_mask`` with the rejected tokens
        (every token of a rejected sequence) set to 0.
    """
    if level not in MIS_LEVELS:
        raise ValueError(f"unknown rejection level {level!r}; allowed: {', '.join(MIS_LEVELS)}")
    if not 0 < lower <= 1.0 <= upper:
        raise ValueError(f"the kept ratio band needs 0 < lower <= 1 <= upper, got [{lower}, {upper}]")
    d, mask = _log_ratios(trainer_log_probs, sampler_log_probs, response_mask)
    ratio = torch.exp(_level_log_ratio(d, mask, level))
    keep = (ratio >= lower) & (ratio <= upper) & (mask != 0)
    return keep.to(response_mask.dtype)


def correction_metrics(
    response_mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    cap: float | None = None,
) -> dict[str, float]:
    """What a correction did to a batch.

    Args:
        response_mask: (B, R) the response mask before the correction.
        weights: (B, R) TIS weights (None: no TIS).
        kept: (B, R) the mask after rejection (None: no rejection).
        cap: the TIS cap (for ``capped_token_share``).

    Returns:
        ``masked_token_share`` (response tokens rejected / response tokens),
        ``masked_seq_share`` (non-empty sequences with every token rejected / non-empty
        sequences), and with ``weights``: ``weight_mean``, ``weight_min``, ``weight_max`` over the
        kept response tokens and ``capped_token_share`` (response tokens whose weight is the cap).
        Shares are 0 and the weight statistics 1 when there is nothing to measure.
    """
    mask = response_mask != 0
    keep = mask if kept is None else (kept != 0) & mask
    tokens = int(mask.sum())
    rows = mask.any(-1)
    out = {
        "masked_token_share": float((mask & ~keep).sum()) / tokens if tokens else 0.0,
        "masked_seq_share": float((rows & ~keep.any(-1)).sum()) / int(rows.sum())
        if bool(rows.any())
        else 0.0,
    }
    if weights is not None:
        w = weights.detach().to(torch.float64)[keep]
        out.update(
            weight_mean=float(w.mean()) if w.numel() else 1.0,
            weight_min=float(w.min()) if w.numel() else 1.0,
            weight_max=float(w.max()) if w.numel() else 1.0,
        )
        if cap is not None:
            capped = (weights.detach() >= torch.tensor(cap, dtype=weights.dtype)) & mask
            out["capped_token_share"] = float(capped.sum()) / tokens if tokens else 0.0
    return out
