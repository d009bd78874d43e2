"""KL penalties against a reference policy, and the controllers that set their coefficient.

Estimators of KL(pi || pi_ref) per sampled token (Schulman, "Approximating KL divergence", 2020),
with ``d = logprob - ref_logprob`` for a token sampled from pi:

- ``kl`` / ``k1``: ``d`` (unbiased, high variance, can be negative);
- ``abs``: ``|d|``;
- ``mse`` / ``k2``: ``0.5 * d^2``;
- ``low_var_kl`` / ``k3``: ``exp(-d) + d - 1`` (unbiased, non-negative), clamped to [-10, 10].
"""

from __future__ import annotations

from typing import Any

import torch

from ppoflow.algos.masked import masked_mean

__all__ = [
    "KL_PENALTY_KINDS",
    "KL_CONTROLLERS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
    "teacher_rewards",
]

KL_PENALTY_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

LOW_VAR_KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference policy.

    Args:
        logprob: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprob: (B, T) log-probs of the same tokens under the reference policy.
        kind: one of ``KL_PENALTY_KINDS`` (see the module docstring).

    Returns:
        (B, T) per-token penalty (not masked).
    """
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("mse", "k2"):
        return 0.5 * diff.square()
    if kind in ("low_var_kl", "k3"):
        log_ratio = torch.clamp(-diff, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        kld = torch.exp(log_ratio) - log_ratio - 1.0
        return torch.clamp(kld, min=-LOW_VAR_KL_CLAMP, max=LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown KL penalty kind {kind!r}; allowed: {', '.join(KL_PENALTY_KINDS)}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al., 2019, "Fine-Tuning Language Models from Human
    Preferences"): steer the observed KL toward ``target_kl``.

    ``error = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
    ``value *= 1 + error * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after observing ``current_kl`` over ``n_steps`` samples."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


#: The KL controllers by the name a config gives (``algorithm.kl_ctrl.type``).
KL_CONTROLLERS: dict[str, type[KLController]] = {"fixed": FixedKLController, "adaptive": AdaptiveKLController}


def get_kl_controller(kind: str, **kw: Any) -> KLController:
    """Build a KL controller.

    - ``get_kl_controller("fixed", kl_coef=0.001)``
    - ``get_kl_controller("adaptive", init_kl_coef=0.001, target_kl=0.1, horizon=10000)``.

    One config serves both kinds: ``kl_coef`` is accepted in place of ``init_kl_coef``, and the
    fixed controller ignores ``target_kl`` and ``horizon``, so
    ``get_kl_controller(c.type, kl_coef=c.kl_coef, target_kl=c.target_kl, horizon=c.horizon)``
    works for either ``c.type``. Any other unknown keyword raises TypeError.
    """
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {kind!r}; allowed: {', '.join(sorted(KL_CONTROLLERS))}")
    if kind == "fixed":
        kw.pop("target_kl", None)
        kw.pop("horizon", None)
    elif "kl_coef" in kw:
        if "init_kl_coef" in kw:
            raise TypeError("give one of kl_coef and init_kl_coef, not both")
        kw["init_kl_coef"] = kw.pop("kl_coef")
    return KL_CONTROLLERS[kind](**kw)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the KL penalty from the rewards ("KL in reward"), then update the controller.

    ``rewards = scores - beta * kl`` on response positions (scores unchanged elsewhere), with
    ``beta = kl_ctrl.value`` before the update. The controller is then updated with the batch's
    mean sequence KL (per-sequence masked mean over the response, averaged over the sequences that
    have a response token) and ``n_steps = B``.

    Args:
        token_level_scores: (B, T) reward-model / rule scores per token.
        old_log_prob: (B, T) log-probs of the rollout policy.
        ref_log_prob: (B, T) log-probs of the reference policy.
        response_mask: (B, T).
        kl_ctrl: a Fixed/AdaptiveKLController (mutated: ``update`` is called).
        kind: KL estimator, see :func:`kl_penalty`.

    Returns:
        ``(token_level_rewards (B, T), metrics)`` with metrics ``actor/reward_kl_penalty`` (the
        mean sequence KL) and ``actor/reward_kl_penalty_coeff`` (the beta that was applied).
    """
    valid = response_mask != 0
    kld = torch.where(valid, kl_penalty(old_log_prob, ref_log_prob, kind), 0.0)
    beta = kl_ctrl.value
    token_level_rewards = torch.where(valid, token_level_scores - beta * kld, token_level_scores)

    sequence_kl = masked_mean(kld, response_mask, dim=-1)
    current_kl = masked_mean(sequence_kl, valid.any(dim=-1)).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


def teacher_rewards(
    log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, response_mask: torch.Tensor, coef: float
) -> torch.Tensor:
    """On-policy distillation's per-token reward: ``coef * (log pi_teacher(y_t) - log pi(y_t))``,
    minus ``coef`` times the ``k1`` estimate of KL(pi || pi_teacher) at each sampled token.

    Args:
        log_prob: (B, T) log-probs of the sampled tokens under the policy that sampled them.
        teacher_log_prob: (B, T) log-probs of the same tokens under the teacher.
        response_mask: (B, T).
        coef: the reward's scale (``algorithm.distill.coef``).

    Returns:
        (B, T) rewards, 0 where the mask is 0.
    """
    return torch.where(response_mask != 0, -coef * kl_penalty(log_prob, teacher_log_prob, "k1"), 0.0)
