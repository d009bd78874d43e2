"""Named recipes: the settings that make PPO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO, RLOO, REINFORCE++,
and on-policy distillation from a teacher (alone or beside GRPO).

A config's top-level ``recipe: <name>`` fills these settings in *under* the config: every key the
config sets itself wins. The recipe's name stays in the config (and so in the manifest's copy);
docs/algorithms.md has the table.

    recipe: dapo
    actor: {clip_ratio_high: 0.3}      # overrides the recipe's 0.28
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["RECIPES", "apply_recipe"]

_GROUP: dict[str, Any] = {  # the outcome-estimator base: responses compared within their prompt, no critic
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "critic": {"enable": False},
}

_GRPO: dict[str, Any] = {
    **_GROUP,
    "actor": {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True, "kl_loss_type": "low_var_kl"},
}

RECIPES: dict[str, dict[str, Any]] = {
    # the defaults: GAE with a critic, PPO's clip at 0.2, token-mean
    "ppo": {"algorithm": {"adv_estimator": "gae"}, "critic": {"enable": True}},
    # Shao et al., 2024: group-normalised outcome advantages, per-sequence mean, KL as a loss
    "grpo": _GRPO,
    # GRPO with the token-mean aggregation (long responses weigh by their tokens)
    "grpo_token_mean": {**_GRPO, "actor": {**_GRPO["actor"], "loss_agg_mode": "token-mean"}},
    # Liu et al., 2025: no std normalisation, a constant normaliser instead of the length, no KL
    "dr_grpo": {
        "algorithm": {**_GROUP["algorithm"], "norm_adv_by_std_in_grpo": False},
        "critic": {"enable": False},
        "actor": {"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": False},
    },
    # Yu et al., 2025: clip-higher, token-mean, dynamic sampling, overlong reward shaping, no KL
    "dapo": {
        "algorithm": {**_GROUP["algorithm"], "dynamic_sampling": {"enable": True, "max_rounds": 10}},
        "critic": {"enable": False},
        "actor": {
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "loss_agg_mode": "token-mean",
            "use_kl_loss": False,
        },
        "reward": {"overlong_buffer": {"enable": True, "penalty_factor": 1.0}},
    },
    # Zheng et al., 2025: the sequence-level ratio, clipped at 3e-4 / 4e-4, per-sequence mean
    "gspo": {
        **_GROUP,
        "actor": {
            "policy_loss": "gspo",
            "clip_ratio_low": 3e-4,
            "clip_ratio_high": 4e-4,
            "loss_agg_mode": "seq-mean-token-mean",
            "use_kl_loss": False,
        },
    },
    # MiniMax-M1 (Chen et al., 2025): clipped stop-gradient IS weights, no lower bound, token-mean
    "cispo": {
        **_GROUP,
        "actor": {
            "policy_loss": "cispo",
            "clip_ratio_low": 1.0,
            "clip_ratio_high": 0.28,
            "loss_agg_mode": "token-mean",
            "use_kl_loss": False,
        },
    },
    # Ahmadian et al., 2024: leave-one-out baseline
    "rloo": {**_GROUP, "algorithm": {**_GROUP["algorithm"], "adv_estimator": "rloo"}},
    # Hu, 2025: discounted returns whitened over the batch, KL in the reward, no critic
    "reinforce_plus_plus": {
        "algorithm": {"adv_estimator": "reinforce_plus_plus", "use_kl_in_reward": True},
        "critic": {"enable": False},
    },
    # on-policy distillation (Agarwal et al., 2024; Thinking Machines, 2025): the teacher's per-token
    # reverse KL as the reward, each token's own (gamma 0), no task reward, no critic, no reference
    "distill": {
        "algorithm": {"adv_estimator": "distill", "use_kl_in_reward": False},
        "critic": {"enable": False},
        "actor": {"loss_agg_mode": "token-mean", "use_kl_loss": False},
        "reward": {"rule": False},
    },
    # the task's reward with GRPO, and the teacher's reverse KL as a loss term (k2: the reverse
    # KL's gradient) in the reference's place; coefficient 1: a token's teacher gradient as in distill
    "distill+rl": {
        **_GROUP,
        "actor": {
            "loss_agg_mode": "seq-mean-token-mean",
            "use_kl_loss": False,
            "teacher_kl_coef": 1.0,
            "teacher_kl_type": "k2",
        },
    },
}


def _under(defaults: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``defaults`` filled in where it sets nothing (mappings merged key by key)."""
    out = copy.deepcopy(defaults)
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _under(out[key], value)
        else:
            out[key] = value
    return out


def apply_recipe(data: Any) -> Any:
    """A raw config mapping with its ``recipe``'s settings filled in under it (others unchanged)."""
    if not isinstance(data, dict) or data.get("recipe") is None:
        return data
    name = data["recipe"]
    if name not in RECIPES:  # the field's own check names it (and the known ones)
        return data
    return _under(RECIPES[name], data)
