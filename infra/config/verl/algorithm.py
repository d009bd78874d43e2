"""The rules for veRL's ``algorithm.*`` keys: the estimator and KL terms, the rollout correction
(``algorithm.rollout_correction``) and DAPO's group filtering (``algorithm.filter_groups``)."""

from __future__ import annotations

import math
from typing import Any

from ppoflow.infra.config.verl.sections import choose
from ppoflow.infra.config.verl.translator import UNSET, Translator

__all__ = ["RULES", "UNBOUNDED_ROUNDS", "RS_LEVELS", "rejection_bounds"]

#: ``algorithm.dynamic_sampling.max_rounds`` for veRL's ``max_num_gen_batches`` <= 0 (no limit):
#: ppoflow bounds the rounds, so "no limit" is this many.
UNBOUNDED_ROUNDS = 1_000_000

#: veRL's ``rollout_rs`` options that ppoflow's ``mis`` levels reproduce (the k1 ones: bounds on
#: the ratio of a token, of a sequence's product, of its geometric mean).
RS_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}

#: veRL's estimators that are another's implementation (the same advantages).
_SAME_ESTIMATOR = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}

RC = "algorithm.rollout_correction"


def _estimator(t: Translator) -> None:
    from ppoflow.algos import ADV_ESTIMATORS, KL_CONTROLLERS, KL_PENALTY_KINDS

    key = "algorithm.adv_estimator"
    name = t.value(key)
    ours = _SAME_ESTIMATOR.get(name, name)
    if ours not in ADV_ESTIMATORS:
        t.refuse(key, f"{name!r}: ppoflow has no such estimator (it has {', '.join(sorted(ADV_ESTIMATORS))})")
    else:
        t.put("algorithm.adv_estimator", ours, key)
    for k in ("gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward"):
        t.copy({f"algorithm.{k}": f"algorithm.{k}"})
    choose(t, "algorithm.kl_penalty", "algorithm.kl_penalty", list(KL_PENALTY_KINDS), "KL estimator")
    choose(t, "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type", list(KL_CONTROLLERS), "KL controller")
    t.copy({f"algorithm.kl_ctrl.{k}": f"algorithm.kl_ctrl.{k}" for k in ("kl_coef", "horizon", "target_kl")})


def rejection_bounds(spec: Any) -> tuple[float, float]:
    """ppoflow's ``(mis_lower, mis_upper)`` for veRL's k1 ``rollout_rs_threshold``: ``"lower_upper"``
    or an upper bound whose lower is its reciprocal. veRL keeps a token when ``-log r`` (r = pi_old /
    pi_sampler) lies in ``[log lower, log upper]``, i.e. when r lies in ``[1/upper, 1/lower]``:
    those are ppoflow's bounds on r. ValueError for a spec that is not one."""
    text = str(spec).strip()
    if "," in text:
        raise ValueError(f"{text!r} gives several thresholds: ppoflow's mis takes one pair of bounds")
    low_text, sep, up_text = text.partition("_")
    upper = float(up_text if sep else low_text)
    lower = float(low_text) if sep else 1.0 / upper
    if lower <= 0 or upper <= 0:
        raise ValueError(f"{text!r}: both bounds must be > 0")
    mis_lower, mis_upper = 1.0 / upper, 1.0 / lower
    if mis_lower > 1.0 or mis_upper < 1.0:
        raise ValueError(
            f"{text!r} keeps ratios pi_old/pi_sampler in [{mis_lower:g}, {mis_upper:g}], which does not "
            "hold 1: ppoflow's mis_lower is at most 1 and its mis_upper at least 1"
        )
    return mis_lower, mis_upper


def _rejection(t: Translator) -> None:
    """``rollout_rs`` / ``rollout_rs_threshold`` -> ``mis``, ``mis_lower``, ``mis_upper`` and
    ``mis_normaliser: kept`` (veRL drops a rejected token from the response mask, so from the
    loss's normaliser as well)."""
    rs, threshold = t.value(f"{RC}.rollout_rs", None), t.value(f"{RC}.rollout_rs_threshold", None)
    keys = (f"{RC}.rollout_rs", f"{RC}.rollout_rs_threshold")
    if rs in (None, UNSET, "", "null"):
        t.same(keys[0], "null: no rejection, as ppoflow's default (mis: none)")
        t.same(keys[1], "read only with rollout_rs")
        return
    options = list(dict.fromkeys(o.strip() for o in str(rs).split(",") if o.strip()))
    if len(options) > 1:
        t.refuse(
            keys[0], f"{rs!r}: several criteria at once; ppoflow's mis takes one of {', '.join(RS_LEVELS)}"
        )
        return
    if options[0] not in RS_LEVELS:
        t.refuse(
            keys[0], f"{rs!r}: ppoflow's mis reproduces only {', '.join(RS_LEVELS)} (bounds on the ratio)"
        )
        return
    if threshold in (None, UNSET):
        t.refuse(keys[1], "rollout_rs needs rollout_rs_threshold (veRL refuses it without)")
        return
    try:
        lower, upper = rejection_bounds(threshold)
    except ValueError as err:
        t.refuse(keys[1], str(err))
        return
    t.put(f"{RC}.mis", RS_LEVELS[options[0]], *keys)
    t.put(f"{RC}.mis_lower", lower, keys[1])
    t.put(f"{RC}.mis_upper", upper, keys[1])
    t.put(f"{RC}.mis_normaliser", "kept", keys[0])


def _correction(t: Translator) -> None:
    level, cap = t.value(f"{RC}.rollout_is", None), t.value(f"{RC}.rollout_is_threshold", 2.0)
    if level in (None, UNSET, "null"):
        t.same(f"{RC}.rollout_is", "null: no importance weights, as ppoflow's default (tis: none)")
        t.same(f"{RC}.rollout_is_threshold", "read only with rollout_is")
    elif level not in ("token", "sequence"):
        t.refuse(f"{RC}.rollout_is", f"{level!r}: ppoflow's tis is token or sequence")
    elif not isinstance(cap, (int, float)) or cap < 1.0:
        t.refuse(f"{RC}.rollout_is_threshold", f"{cap!r}: ppoflow's tis_cap is a number >= 1")
    else:
        t.put(f"{RC}.tis", level, f"{RC}.rollout_is")
        t.put(f"{RC}.tis_cap", float(cap), f"{RC}.rollout_is_threshold")
    _rejection(t)
    bypass = bool(t.value(f"{RC}.bypass_mode", False))
    corrects = any(k in t.out for k in (f"{RC}.tis", f"{RC}.mis"))
    if bypass and corrects:
        t.refuse(
            f"{RC}.bypass_mode",
            "with rollout_is or rollout_rs: ppoflow's sampler behaviour takes no "
            "correction (PPO's clip on pi / pi_sampler is the correction); drop one",
        )
    t.put(f"{RC}.behaviour", "sampler" if bypass else "trainer", f"{RC}.bypass_mode")


def _filter_groups(t: Translator) -> None:
    """DAPO's group filtering -> ``algorithm.dynamic_sampling``; veRL generates ``gen_batch_size``
    prompts a round and ppoflow ``train_batch_size``, so ``max_rounds`` keeps veRL's budget of
    prompts (the batch trained is the same: the first informative groups in data order)."""
    fg, gen = "algorithm.filter_groups", "data.gen_batch_size"
    train = t.value("data.train_batch_size")
    if not t.value(f"{fg}.enable", False):
        t.same(f"{fg}.enable", "false: no group filtering, as ppoflow's default")
        for key in (f"{fg}.metric", f"{fg}.max_num_gen_batches"):
            t.same(key, "read only with filter_groups.enable=true")
        if t.gave(gen) and t.value(gen) != train:
            t.refuse(
                gen,
                f"veRL then trains on {t.value(gen)} prompts a step: ppoflow trains data.train_batch_size "
                "a step; make them equal",
            )
        t.same(gen, "equal to data.train_batch_size")
        return
    t.put("algorithm.dynamic_sampling.enable", True, f"{fg}.enable")
    metric = t.value(f"{fg}.metric", None)
    overlong = bool(t.out.get("reward.overlong_buffer.enable"))
    shaped = {
        "seq_reward": overlong,
        "seq_final_reward": overlong or bool(t.out.get("algorithm.use_kl_in_reward")),
    }
    if metric in (None, UNSET):
        t.refuse(
            f"{fg}.metric", "filter_groups.enable=true needs a metric (veRL's is required): acc or score"
        )
    elif metric in ("acc", "score") or shaped.get(metric) is False:
        t.mapped[f"{fg}.metric"] = ["algorithm.dynamic_sampling (ppoflow compares the rule's score)"]
    elif metric in shaped:
        t.refuse(
            f"{fg}.metric",
            f"{metric!r} holds the overlong penalty (or the KL term): ppoflow's dynamic "
            "sampling compares the rule's score before shaping; use acc or score",
        )
    else:
        t.refuse(
            f"{fg}.metric", f"{metric!r}: ppoflow's dynamic sampling compares the rule's score (acc, score)"
        )
    batches = t.value(f"{fg}.max_num_gen_batches", 0)
    size = t.value(gen, train)
    rounds = UNBOUNDED_ROUNDS if batches <= 0 else math.ceil(batches * size / train)
    if batches <= 0:
        t.notes.append(f"algorithm.dynamic_sampling.max_rounds: {UNBOUNDED_ROUNDS} for veRL's no limit")
    t.put("algorithm.dynamic_sampling.max_rounds", rounds, f"{fg}.max_num_gen_batches", gen)


RULES = (_estimator, _correction, _filter_groups)
