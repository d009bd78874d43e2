"""Policy losses and their registry: ``vanilla`` (PPO), ``gspo``, ``gspo_token``, ``cispo``.

Every policy loss takes the same arguments and returns ``(loss, metrics)``:

    loss, metrics = get_policy_loss("gspo")(old_log_prob, log_prob, advantages, response_mask,
                                            clip_ratio_low=3e-4, clip_ratio_high=4e-4,
                                            clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean")

``old_log_prob``, ``log_prob`` (carries the gradient), ``advantages`` and ``response_mask`` are
(B, T); the per-token loss matrix is reduced with :func:`ppoflow.algos.losses.agg_loss` in
``loss_agg_mode``, so the trainer's exact gradient accumulation (global token / sequence counts)
holds for every loss. ``metrics`` maps short names (``pg_clipfrac``, ``pg_clipfrac_low``,
``pg_clipfrac_high``, ``ppo_kl``, ...) to detached scalars.

The keyword ``rollout_is_weights`` ((B, T), no gradient; default None = 1) carries the rollout
correction's importance weights (``ppoflow.algos.correction``): every loss multiplies its per-token
loss matrix by them before aggregating, so a correction composes with every loss here. A loss
registered without that keyword still works, except with ``algorithm.rollout_correction.tis`` on
(the config refuses that pairing).

Far off-policy (asynchronous training, a stale sampler) a ratio can be huge. PPO's clip does not
bound ``-A * ratio`` for a negative advantage: ``vanilla`` bounds it with the dual clip
(``clip_ratio_c``), and so do ``gspo`` and ``gspo_token`` (on the sequence ratio; their papers have
no dual clip, and at their on-policy ratios, within 1 +- 4e-4, it never acts). ``cispo``'s weight
is clipped on both sides already.

Add a loss with ``@register_policy_loss("name")``; ``actor.policy_loss`` accepts every registered
name (the config validates against this registry).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppoflow.algos.losses import LOG_RATIO_CLAMP, agg_loss, compute_policy_loss, weighted
from ppoflow.algos.masked import masked_mean, masked_sum

__all__ = [
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "gspo_token_policy_loss",
    "cispo_policy_loss",
]

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under ``name``.

    Registering a different function under a name already taken raises ValueError.
    """

    def decorator(fn: PolicyLoss) -> PolicyLoss:
        existing = POLICY_LOSSES.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({existing.__qualname__})")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered under ``name``; ValueError listing the known names otherwise."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(sorted(POLICY_LOSSES))}") from None


def _clamped_log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(torch.float32), mask).detach()


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with asymmetric and dual clip: :func:`compute_policy_loss`.

    Extra metrics: ``pg_clipfrac_low`` (tokens with ``A < 0`` and ``ratio < 1 - clip_ratio_low``),
    ``pg_clipfrac_high`` (``A > 0`` and ``ratio > 1 + clip_ratio_high``): the two sides of
    ``pg_clipfrac``. Paper defaults (Schulman et al., 2017): 0.2 both sides; DAPO's clip-higher
    raises the upper one to 0.28.
    """
    loss, clipfrac, ppo_kl, dual = compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
    )
    ratio = torch.exp(_clamped_log_ratio(old_log_prob, log_prob)).detach()
    return loss, {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_low": _fraction((advantages < 0) & (ratio < 1 - clip_ratio_low), response_mask),
        "pg_clipfrac_high": _fraction((advantages > 0) & (ratio > 1 + clip_ratio_high), response_mask),
        "pg_clipfrac_lower": dual.detach(),
        "ppo_kl": ppo_kl.detach(),
    }


def _sequence_log_ratio(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """(B,) mean token log-ratio of each sequence (0 for a row without valid tokens), clamped."""
    lengths = (response_mask != 0).sum(-1).clamp(min=1)
    mean = masked_sum(log_prob - old_log_prob, response_mask, dim=-1) / lengths
    return torch.clamp(mean, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def _dual_clip(loss: torch.Tensor, advantages: torch.Tensor, clip_ratio_c: float) -> torch.Tensor:
    """PPO's dual clip (Ye et al., 2020): where ``A < 0`` the loss is at most ``-A * clip_ratio_c``
    (a constant: no gradient beyond it), so a huge ratio on a bad sample cannot blow the loss up."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    return torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)


def _sequence_metrics(
    seq_ratio: torch.Tensor,
    seq_adv: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """GSPO's metrics, over the sequences with at least one valid token: clip fractions per side
    (the sequences whose clipped term is active), the dual clip's (``A < 0`` and a sequence ratio
    above ``clip_ratio_c``) and the sequence ratio's mean / min / max."""
    s = seq_ratio.detach()
    has = (response_mask != 0).any(-1)
    low = (seq_adv < 0) & (s < 1 - clip_ratio_low)
    high = (seq_adv > 0) & (s > 1 + clip_ratio_high)
    valid = s[has]
    empty = s.new_zeros(())
    return {
        "pg_clipfrac": _fraction(low | high, has),
        "pg_clipfrac_low": _fraction(low, has),
        "pg_clipfrac_high": _fraction(high, has),
        "pg_clipfrac_lower": _fraction((seq_adv < 0) & (s > clip_ratio_c), has),
        "ppo_kl": masked_mean(-_clamped_log_ratio(old_log_prob, log_prob), response_mask).detach(),
        "seq_ratio/mean": valid.mean() if valid.numel() else empty + 1.0,
        "seq_ratio/min": valid.min() if valid.numel() else empty + 1.0,
        "seq_ratio/max": valid.max() if valid.numel() else empty + 1.0,
    }


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025), sequence level.

    ``s_i = exp(mean_t(log_prob - old_log_prob))`` over sequence i's valid tokens (the geometric
    mean of its token ratios), ``A_i`` = the mean of its advantages (the outcome estimators give
    every token the same one), and the sequence's loss
    ``l_i = max(-A_i * s_i, -A_i * clamp(s_i, 1 - clip_ratio_low, 1 + clip_ratio_high))``,
    for ``A_i < 0`` at most ``-A_i * clip_ratio_c`` (the dual clip: without it a sequence far off
    policy, ``s_i`` up to e^20, gives a loss and a gradient of ``|A_i| * s_i``), placed on each of
    its tokens (times ``rollout_is_weights``) and aggregated in ``loss_agg_mode``. With
    ``seq-mean-token-mean`` (the paper's) that is ``mean_i l_i``. Paper defaults: clip ranges
    3e-4 (low) and 4e-4 (high); the paper has no dual clip.
    """
    seq_log_ratio = _sequence_log_ratio(old_log_prob, log_prob, response_mask)
    seq_ratio = torch.exp(seq_log_ratio)
    lengths = (response_mask != 0).sum(-1).clamp(min=1)
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / lengths
    unclipped = -seq_adv * seq_ratio
    clipped = -seq_adv * torch.clamp(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    seq_loss = _dual_clip(torch.maximum(unclipped, clipped), seq_adv, clip_ratio_c)
    loss_mat = seq_loss.unsqueeze(-1).expand_as(log_prob)
    loss = agg_loss(weighted(loss_mat, rollout_is_weights), response_mask, loss_agg_mode)
    metrics = _sequence_metrics(
        seq_ratio,
        seq_adv,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        old_log_prob,
        log_prob,
    )
    return loss, metrics


@register_policy_loss("gspo_token")
def gspo_token_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al., 2025): per-token advantages with the sequence's ratio.

    ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]`` (its value is ``s_i``, its gradient flows through
    token t only), per token ``max(-A_t * s_i,t, -A_t * clamp(s_i,t, 1 - low, 1 + high))``, for
    ``A_t < 0`` at most ``-A_t * clip_ratio_c`` (the dual clip, as in :func:`gspo_policy_loss`:
    ``s_i`` is a constant of the token's gradient, so without it a far-off sequence gives every
    negative-advantage token a gradient ``|A_t| * s_i``), times ``rollout_is_weights``,
    aggregated in ``loss_agg_mode`` (the paper's: ``seq-mean-token-mean``). When every token of a
    sequence has the same advantage its gradient equals GSPO's. Paper defaults: 3e-4 / 4e-4.
    """
    seq_log_ratio = _sequence_log_ratio(old_log_prob, log_prob, response_mask)
    token_ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach())
    unclipped = -advantages * token_ratio
    clipped = -advantages * torch.clamp(token_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = _dual_clip(torch.maximum(unclipped, clipped), advantages, clip_ratio_c)
    loss = agg_loss(weighted(per_token, rollout_is_weights), response_mask, loss_agg_mode)
    lengths = (response_mask != 0).sum(-1).clamp(min=1)
    seq_adv = masked_sum(advantages, response_mask, dim=-1) / lengths
    metrics = _sequence_metrics(
        torch.exp(seq_log_ratio),
        seq_adv,
        response_mask,
        clip_ratio_low,
        clip_ratio_high,
        clip_ratio_c,
        old_log_prob,
        log_prob,
    )
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al., 2025): REINFORCE with clipped, stop-gradient IS weights.

    Per token ``-sg(clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_prob``
    (times ``rollout_is_weights``), aggregated in ``loss_agg_mode`` (the paper's: ``token-mean``). Unlike PPO no token's gradient
    is dropped: the weight is bounded, the gradient ``w * A * grad log_prob`` always flows. The
    paper sets no lower bound (``clip_ratio_low: 1.0``, weights >= 0) and tunes only the upper
    one (it gives no value; 0.28 here, DAPO's clip-higher). Ratios are positive, so any
    ``clip_ratio_low`` >= 1 is no lower bound (recipes elsewhere write 10). ``clip_ratio_c`` is
    not used.
    Metrics: the share of tokens whose weight is clipped, per side.
    """
    ratio = torch.exp(_clamped_log_ratio(old_log_prob, log_prob))
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss = agg_loss(
        weighted(-weight * advantages * log_prob, rollout_is_weights), response_mask, loss_agg_mode
    )
    r = ratio.detach()
    low, high = r < 1.0 - clip_ratio_low, r > 1.0 + clip_ratio_high
    return loss, {
        "pg_clipfrac": _fraction(low | high, response_mask),
        "pg_clipfrac_low": _fraction(low, response_mask),
        "pg_clipfrac_high": _fraction(high, response_mask),
        "ppo_kl": masked_mean(-_clamped_log_ratio(old_log_prob, log_prob), response_mask).detach(),
    }
