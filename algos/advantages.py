"""Advantage estimators and their registry.

All estimators take padded (B, T) tensors over the response (T = padded response length) and a
``response_mask`` (B, T) that is 1 on response tokens, and return ``(advantages, returns)``, both
(B, T) and 0 where the mask is 0.

Token-level estimators (``gae``, ``reinforce_plus_plus``) run a backward recursion over the
response. Positions whose mask is 0 are *skipped*: they get no advantage, and they do not cut the
recursion either; the next valid position's value and the running sum carry across them. The value
after the last response token is 0 (the episode ends there).

Outcome estimators (``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``) reduce each response to
one score, the sum of its token-level rewards, compare it with the other responses to the same
prompt (same entry of ``index``), and broadcast the result over the response tokens.

``distill`` (on-policy distillation) takes per-token rewards from a teacher and returns their
discounted return, with no baseline.

Add an estimator with ``@register_adv_estimator("name")``; :func:`compute_advantage` passes it the
keyword arguments its signature names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ppoflow.algos.masked import masked_sum, masked_whiten

__all__ = [
    "ADV_ESTIMATORS",
    "estimator_inputs",
    "estimator_reads_values",
    "register_adv_estimator",
    "get_adv_estimator",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_distill_advantage",
]

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator: register an advantage estimator under ``name``.

    Registering a different function under a name already taken raises ValueError.
    """

    def decorator(fn: AdvEstimator) -> AdvEstimator:
        existing = ADV_ESTIMATORS.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered ({existing.__qualname__})")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    """The estimator registered under ``name``; ValueError listing the known names otherwise."""
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {', '.join(sorted(ADV_ESTIMATORS))}"
        ) from None


def estimator_inputs(name: str) -> set[str]:
    """What estimator ``name`` cannot run without, of ``values`` (a critic) and ``index`` (groups
    of responses to one prompt): the parameters its signature requires."""
    params = inspect.signature(get_adv_estimator(name)).parameters
    return {k for k in ("values", "index") if k in params and params[k].default is inspect.Parameter.empty}


def estimator_reads_values(name: str) -> bool:
    """Whether estimator ``name`` takes the critic's ``values`` at all (required or optional):
    what decides ``critic.enable`` when a config leaves it unset."""
    return "values" in inspect.signature(get_adv_estimator(name)).parameters


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: Any = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator ``name`` with the arguments it takes.

    The common arguments (``values``, ``index``, ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``:
    the fields of the algorithm config) are passed only to estimators whose signature names them,
    so one call site serves every estimator. An estimator that needs ``values`` or ``index`` and
    gets ``None`` raises ValueError. Extra keyword arguments (e.g. ``epsilon``) are passed through;
    one the estimator does not accept raises TypeError.

    Args:
        name: a key of ``ADV_ESTIMATORS``.
        token_level_rewards: (B, T).
        response_mask: (B, T).
        values: (B, T) critic values, for ``gae``.
        index: (B,) group id per sample (numpy array of str or int), for the outcome estimators.
        gamma: discount, for ``gae`` and ``reinforce_plus_plus``.
        lam: GAE lambda.
        norm_adv_by_std_in_grpo: GRPO divides by the group std (False: Dr. GRPO).

    Returns:
        ``(advantages, returns)``, each (B, T).
    """
    fn = get_adv_estimator(name)
    params = inspect.signature(fn).parameters
    common = {
        "values": values,
        "index": index,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
    }
    call: dict[str, Any] = {"token_level_rewards": token_level_rewards, "response_mask": response_mask}
    for key, value in common.items():
        if key not in params:
            continue
        if value is None and params[key].default is inspect.Parameter.empty:
            raise ValueError(f"advantage estimator {name!r} needs {key!r}")
        call[key] = value
    unknown = [key for key in kw if key not in params]
    if unknown:
        raise TypeError(f"advantage estimator {name!r} does not take {', '.join(unknown)}")
    call.update(kw)
    return fn(**call)


def _discounted_backward(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    values: torch.Tensor | None = None,
    lam: float = 1.0,
) -> torch.Tensor:
    """Backward recursion over valid positions only (shared by GAE and REINFORCE++).

    With ``values``: GAE, ``A_t = delta_t + gamma * lam * A_next`` with
    ``delta_t = r_t + gamma * V_next - V_t``; without: return-to-go ``G_t = r_t + gamma * G_next``.
    ``next`` is the next valid position (value 0 after the last one). Shapes (B, T) in and out;
    0 where ``mask`` is 0.
    """
    valid = mask != 0
    batch, length = rewards.shape
    dtype = rewards.dtype if values is None else torch.promote_types(rewards.dtype, values.dtype)
    out = torch.zeros((batch, length), dtype=dtype, device=rewards.device)
    running = torch.zeros(batch, dtype=dtype, device=rewards.device)
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    for t in reversed(range(length)):
        valid_t = valid[:, t]
        if values is None:
            candidate = rewards[:, t] + gamma * running
        else:
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            next_value = torch.where(valid_t, values[:, t].to(dtype), next_value)
        running = torch.where(valid_t, candidate, running)
        out[:, t] = torch.where(valid_t, candidate, 0.0)
    return out


@register_adv_estimator("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over the response tokens.

    Backward over valid positions t (masked positions skipped, see the module docstring):
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
    with ``V_next = A_next = 0`` after the last response token.

    Args:
        token_level_rewards: (B, T).
        values: (B, T) critic values at rollout time.
        response_mask: (B, T).
        gamma: discount.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, each (B, T), 0 where the mask is 0. ``returns = A + V`` (the
        critic's targets, from the raw advantages); ``advantages`` are whitened over the response
        positions of the whole batch.
    """
    with torch.no_grad():
        raw = _discounted_backward(token_level_rewards, response_mask, gamma, values=values, lam=lam)
        valid = response_mask != 0
        returns = torch.where(valid, raw + values, 0.0)
        advantages = masked_whiten(raw, response_mask)
    return advantages, returns


def _group_ids(index: Any, batch: int) -> tuple[torch.Tensor, int]:
    """Map per-sample group labels (B,) (str, int, ...) to dense ids 0..G-1; returns (ids, G)."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    labels = np.asarray(index)
    if labels.shape != (batch,):
        raise ValueError(f"index has shape {labels.shape}, expected ({batch},)")
    _, inverse = np.unique(labels, return_inverse=True)
    inverse = np.asarray(inverse, dtype=np.int64).reshape(-1)
    n_groups = int(inverse.max()) + 1 if batch else 0
    return torch.from_numpy(inverse), n_groups


def _group_stats(scores: torch.Tensor, index: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, group mean and unbiased group std of ``scores`` (B,); each (B,).

    The std of a group of one is returned as NaN (undefined); callers decide what it means.
    """
    ids, n_groups = _group_ids(index, scores.shape[0])
    ids = ids.to(scores.device)

    def group_sums(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, values)

    counts = group_sums(torch.ones_like(scores))
    means = group_sums(scores) / counts
    stds = torch.sqrt(group_sums((scores - means[ids]) ** 2) / (counts - 1))
    return counts[ids], means[ids], stds[ids]


def _outcome_groups(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each response's outcome score (the sum of its token-level rewards) and its group's size,
    mean and std (:func:`_group_stats`): ``(scores, counts, means, stds)``, each (B,)."""
    scores = masked_sum(token_level_rewards, response_mask, dim=-1)
    return (scores, *_group_stats(scores, index))


def _broadcast(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, T), 0 where the mask is 0."""
    return torch.where(response_mask != 0, scores.unsqueeze(-1), 0.0)


@register_adv_estimator("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al., 2024): outcome score normalised within its group.

    ``A_i = (s_i - mean_g) / (std_g + epsilon)`` (unbiased std), or ``s_i - mean_g`` when
    ``norm_adv_by_std_in_grpo`` is False (Dr. GRPO). A group of one has mean 0 and std 1, so its
    advantage is ``s_i / (1 + epsilon)`` (``s_i`` without std normalisation).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) numpy array of group labels (str or int): the prompt each response answers.
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the group std.

    Returns:
        ``(advantages, returns)``, each (B, T), equal, broadcast over the response, 0 elsewhere.
    """
    with torch.no_grad():
        scores, counts, means, stds = _outcome_groups(token_level_rewards, response_mask, index)
        single = counts < 2
        means = torch.where(single, 0.0, means)
        stds = torch.where(single, 1.0, stds)
        centred = scores - means
        if norm_adv_by_std_in_grpo:
            centred = centred / (stds + epsilon)
        advantages = _broadcast(centred, response_mask)
    return advantages, advantages


@register_adv_estimator("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al., 2024): outcome score minus the mean of the *other* group members.

    ``A_i = s_i - (sum_g - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_g)`` for a group of n > 1;
    a group of one has no baseline to compare with and gets 0.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) numpy array of group labels (str or int).

    Returns:
        ``(advantages, returns)``, each (B, T), equal, broadcast over the response, 0 elsewhere.
    """
    with torch.no_grad():
        scores, counts, means, _ = _outcome_groups(token_level_rewards, response_mask, index)
        single = counts < 2
        leave_one_out = counts / torch.where(single, 1.0, counts - 1) * (scores - means)
        advantages = _broadcast(torch.where(single, 0.0, leave_one_out), response_mask)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): discounted return-to-go, whitened over the batch.

    ``G_t = r_t + gamma * G_next`` over valid positions (masked positions skipped, ``G`` after the
    last response token is 0).

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        gamma: discount.

    Returns:
        ``(advantages, returns)``, each (B, T), 0 where the mask is 0: ``returns`` are the raw
        returns-to-go, ``advantages`` the same whitened over the response positions.
    """
    with torch.no_grad():
        returns = _discounted_backward(token_level_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask)
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``s_i - mean_g``, broadcast, then whitened over the batch.

    A group of one uses baseline 0.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        index: (B,) numpy array of group labels (str or int).

    Returns:
        ``(advantages, returns)``, each (B, T), equal, 0 where the mask is 0.
    """
    with torch.no_grad():
        scores, counts, means, _ = _outcome_groups(token_level_rewards, response_mask, index)
        baseline = torch.where(counts < 2, 0.0, means)
        advantages = masked_whiten(_broadcast(scores - baseline, response_mask), response_mask)
    return advantages, advantages


@register_adv_estimator("distill")
def compute_distill_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each token's discounted return of per-token rewards, no baseline.

    With the teacher's rewards ``r_t = coef * (log pi_teacher(y_t) - log pi(y_t))``
    (:func:`ppoflow.algos.teacher_rewards`), ``A_t = r_t + gamma * A_next`` over valid positions
    (masked positions skipped); ``gamma`` 0 gives ``A_t = r_t``, whose policy gradient on the
    policy's own samples is minus the per-token reverse KL's. Neither centred nor whitened: the
    advantage keeps the KL's scale and sign.

    Args:
        token_level_rewards: (B, T).
        response_mask: (B, T).
        gamma: discount (``algorithm.distill.gamma``).

    Returns:
        ``(advantages, returns)``, each (B, T), equal, 0 where the mask is 0.
    """
    with torch.no_grad():
        returns = _discounted_backward(token_level_rewards, response_mask, gamma)
    return returns, returns
