"""algos advantage estimators and their registry, against plain-Python references.

Token-level estimators skip masked positions (holes in the middle of a response neither get an
advantage nor cut the recursion); outcome estimators group by a per-sample index of str or int.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    register_adv_estimator,
)
from tests.support.algo_reference import F64, SETTINGS, SHAPES, close, randn, random_mask, ref_whiten, rows

UNIT = st.floats(0.0, 1.0)


# ---------------------------------------------------------------- references


def ref_gae(r: list[list[float]], v: list[list[float]], m: list[list[float]], gamma: float, lam: float):
    """Raw GAE and returns per row, walking only the valid positions backwards."""
    advs, rets = [], []
    for rr, vr, mr in zip(r, v, m):
        adv = [0.0] * len(rr)
        next_value, running = 0.0, 0.0
        for t in reversed(range(len(rr))):
            if not mr[t]:
                continue
            delta = rr[t] + gamma * next_value - vr[t]
            running = delta + gamma * lam * running
            adv[t] = running
            next_value = vr[t]
        advs.append(adv)
        rets.append([a + val if k else 0.0 for a, val, k in zip(adv, vr, mr)])
    return advs, rets


def ref_return_to_go(r: list[list[float]], m: list[list[float]], gamma: float):
    out = []
    for rr, mr in zip(r, m):
        ret, running = [0.0] * len(rr), 0.0
        for t in reversed(range(len(rr))):
            if mr[t]:
                running = rr[t] + gamma * running
                ret[t] = running
        out.append(ret)
    return out


def ref_scores(r, m) -> list[float]:
    return [sum(x for x, k in zip(rr, mr) if k) for rr, mr in zip(r, m)]


def ref_groups(index) -> dict:
    groups: dict = {}
    for i, key in enumerate(index):
        groups.setdefault(key, []).append(i)
    return groups


def broadcast(per_seq: list[float], m) -> list[list[float]]:
    return [[s if k else 0.0 for k in mr] for s, mr in zip(per_seq, m)]


def ref_grpo(r, m, index, eps=1e-6, norm=True):
    scores = ref_scores(r, m)
    out = [0.0] * len(scores)
    for members in ref_groups(index).values():
        vals = [scores[i] for i in members]
        if len(vals) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(vals) / len(vals)
            sd = math.sqrt(sum((x - mu) ** 2 for x in vals) / (len(vals) - 1))
        for i in members:
            out[i] = (scores[i] - mu) / (sd + eps) if norm else scores[i] - mu
    return broadcast(out, m)


def ref_rloo(r, m, index):
    scores = ref_scores(r, m)
    out = [0.0] * len(scores)
    for members in ref_groups(index).values():
        if len(members) < 2:
            continue
        total = sum(scores[i] for i in members)
        for i in members:
            out[i] = scores[i] - (total - scores[i]) / (len(members) - 1)
    return broadcast(out, m)


def ref_rpp_baseline(r, m, index):
    scores = ref_scores(r, m)
    out = list(scores)
    for members in ref_groups(index).values():
        if len(members) > 1:
            mu = sum(scores[i] for i in members) / len(members)
            for i in members:
                out[i] = scores[i] - mu
    return ref_whiten(broadcast(out, m), m)


def random_index(gen: torch.Generator, batch: int, as_str: bool) -> np.ndarray:
    """Group labels with groups of size 1..batch in shuffled order, as str (object array) or int."""
    groups = torch.randint(0, max(1, batch // 2), (batch,), generator=gen).tolist()
    if as_str:
        return np.array([f"uid-{g}" for g in groups], dtype=object)
    return np.array([g * 7 + 100 for g in groups], dtype=np.int64)


# ---------------------------------------------------------------- GAE


@SETTINGS
@given(**SHAPES, gamma=UNIT, lam=UNIT)
def test_gae_matches_reference(seed, batch, length, gamma, lam):
    gen = torch.Generator().manual_seed(seed)
    rewards, values = randn(gen, batch, length), randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    raw, expected_ret = ref_gae(rows(rewards), rows(values), rows(mask), gamma, lam)
    close(ret, expected_ret)
    close(adv, ref_whiten(raw, rows(mask)))


def test_gae_holes_are_skipped_not_cut():
    # one row: tokens at t=0, 2, 3 are real, t=1 is a hole, t=4 is padding (garbage inside)
    rewards = torch.tensor([[0.5, 99.0, -1.0, 2.0, 99.0]], dtype=F64)
    values = torch.tensor([[0.1, 99.0, 0.3, 0.4, 99.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=F64)
    gamma, lam = 0.9, 0.8
    d3 = 2.0 + gamma * 0.0 - 0.4
    a3 = d3
    d2 = -1.0 + gamma * 0.4 - 0.3
    a2 = d2 + gamma * lam * a3
    d0 = 0.5 + gamma * 0.3 - 0.1  # the value after t=0 is the one at t=2, across the hole
    a0 = d0 + gamma * lam * a2
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    close(ret, [[a0 + 0.1, 0.0, a2 + 0.3, a3 + 0.4, 0.0]])


def test_gae_single_token_and_empty_batch():
    rewards = torch.tensor([[1.0], [2.0], [3.0]], dtype=F64)
    values = torch.tensor([[0.5], [0.5], [0.5]], dtype=F64)
    mask = torch.tensor([[1.0], [0.0], [1.0]], dtype=F64)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    close(ret, [[1.0], [0.0], [3.0]])  # T=1: A = r - V, return = r
    std = math.sqrt(2.0)  # raw advantages 0.5 and 2.5: unbiased std sqrt(2)
    close(adv, [[-1.0 / math.sqrt(std**2 + 1e-8)], [0.0], [1.0 / math.sqrt(std**2 + 1e-8)]])
    adv, ret = compute_gae_advantage_return(rewards, values, torch.zeros_like(mask), 1.0, 0.95)
    close(adv, [[0.0]] * 3)
    close(ret, [[0.0]] * 3)


def test_gae_with_float32_rewards_and_bool_mask():
    gen = torch.Generator().manual_seed(5)
    rewards, values = randn(gen, 3, 4), randn(gen, 3, 4)
    mask = random_mask(gen, 3, 4)
    adv32, ret32 = compute_gae_advantage_return(rewards.float(), values.float(), mask.bool(), 0.99, 0.95)
    adv64, ret64 = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert adv32.dtype == torch.float32
    torch.testing.assert_close(adv32.double(), adv64, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret32.double(), ret64, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- REINFORCE++


@SETTINGS
@given(**SHAPES, gamma=UNIT)
def test_reinforce_plus_plus_matches_reference(seed, batch, length, gamma):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    adv, ret = compute_reinforce_plus_plus_advantage(rewards, mask, gamma)
    expected_ret = ref_return_to_go(rows(rewards), rows(mask), gamma)
    close(ret, expected_ret)
    close(adv, ref_whiten(expected_ret, rows(mask)))


# ---------------------------------------------------------------- outcome estimators


@SETTINGS
@given(**SHAPES, as_str=st.booleans(), norm=st.booleans())
def test_grpo_matches_reference(seed, batch, length, as_str, norm):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    index = random_index(gen, batch, as_str)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    expected = ref_grpo(rows(rewards), rows(mask), list(index), norm=norm)
    close(adv, expected)
    close(ret, expected)


@SETTINGS
@given(**SHAPES, as_str=st.booleans())
def test_rloo_matches_reference(seed, batch, length, as_str):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    index = random_index(gen, batch, as_str)
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, index)
    expected = ref_rloo(rows(rewards), rows(mask), list(index))
    close(adv, expected)
    close(ret, expected)


@SETTINGS
@given(**SHAPES, as_str=st.booleans())
def test_reinforce_plus_plus_baseline_matches_reference(seed, batch, length, as_str):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    index = random_index(gen, batch, as_str)
    adv, ret = compute_reinforce_plus_plus_baseline_advantage(rewards, mask, index)
    expected = ref_rpp_baseline(rows(rewards), rows(mask), list(index))
    close(adv, expected)
    close(ret, expected)


def test_outcome_estimators_hand_values():
    # outcome rewards on the last real token; groups "a" (3 responses), "b" (1 response)
    rewards = torch.tensor([[0, 0, 1.0], [0, 0.0, 0], [0, 2.0, 0], [0, 0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=F64)
    index = np.array(["a", "a", "a", "b"], dtype=object)
    # group a: scores 1, 0, 2 -> mean 1, unbiased std 1
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.0)
    close(grpo, [[0, 0, 0], [-1, 0, 0], [1, 1, 0], [5, 5, 5]])
    rloo, _ = compute_rloo_outcome_advantage(rewards, mask, index)
    # 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5, singleton 0
    close(rloo, [[0, 0, 0], [-1.5, 0, 0], [1.5, 1.5, 0], [0, 0, 0]])
    dr_grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    close(dr_grpo, [[0, 0, 0], [-1, 0, 0], [1, 1, 0], [5, 5, 5]])
    # int labels give the same grouping
    int_index = np.array([7, 7, 7, 3])
    close(compute_rloo_outcome_advantage(rewards, mask, int_index)[0], rloo)
    with pytest.raises(ValueError, match="index"):
        compute_rloo_outcome_advantage(rewards, mask, int_index[:3])


def test_grpo_identical_scores_give_zero():
    rewards = torch.ones(4, 2, dtype=F64)
    mask = torch.ones(4, 2, dtype=F64)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, np.array([0, 0, 1, 1]))
    close(adv, torch.zeros(4, 2, dtype=F64))


# ---------------------------------------------------------------- registry and dispatch


def test_registry_names_and_unknown():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(
        ADV_ESTIMATORS
    )
    assert get_adv_estimator("gae") is compute_gae_advantage_return
    with pytest.raises(ValueError, match="gae.*grpo"):
        get_adv_estimator("ppo")


def test_compute_advantage_dispatch_matches_direct_calls():
    gen = torch.Generator().manual_seed(21)
    rewards, values = randn(gen, 4, 5), randn(gen, 4, 5)
    mask = random_mask(gen, 4, 5)
    index = np.array(["p0", "p0", "p1", "p1"], dtype=object)
    common = dict(
        token_level_rewards=rewards, response_mask=mask, values=values, index=index, gamma=0.9, lam=0.7
    )
    cases = {
        "gae": compute_gae_advantage_return(rewards, values, mask, 0.9, 0.7),
        "grpo": compute_grpo_outcome_advantage(rewards, mask, index),
        "rloo": compute_rloo_outcome_advantage(rewards, mask, index),
        "reinforce_plus_plus": compute_reinforce_plus_plus_advantage(rewards, mask, 0.9),
        "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_advantage(rewards, mask, index),
    }
    for name, (adv, ret) in cases.items():
        got_adv, got_ret = compute_advantage(name, **common)
        close(got_adv, adv)
        close(got_ret, ret)
    got, _ = compute_advantage("grpo", **common, epsilon=0.5, norm_adv_by_std_in_grpo=False)
    close(got, compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)[0])
    got, _ = compute_advantage("grpo", **common, epsilon=0.5)
    close(got, compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.5)[0])
    # the algorithm config's fields go to every estimator; those that do not use them ignore them
    got, _ = compute_advantage("gae", **common, norm_adv_by_std_in_grpo=False)
    close(got, cases["gae"][0])


def test_compute_advantage_errors():
    rewards, mask = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(TypeError, match="epsilon"):
        compute_advantage(
            "rloo", token_level_rewards=rewards, response_mask=mask, index=np.array([0, 0]), epsilon=1
        )
    with pytest.raises(ValueError, match="known"):
        compute_advantage("nope", token_level_rewards=rewards, response_mask=mask)


def test_register_custom_estimator():
    @register_adv_estimator("test_constant")
    def constant(token_level_rewards, response_mask, gamma, scale=1.0):
        adv = response_mask.to(token_level_rewards.dtype) * gamma * scale
        return adv, adv

    try:
        mask = torch.tensor([[1.0, 0.0]], dtype=F64)
        adv, _ = compute_advantage(
            "test_constant", token_level_rewards=mask, response_mask=mask, gamma=0.5, values=mask, scale=4.0
        )
        close(adv, [[2.0, 0.0]])
        register_adv_estimator("test_constant")(constant)  # same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_constant")(lambda **kw: None)
    finally:
        ADV_ESTIMATORS.pop("test_constant", None)


# ---------------------------------------------------------------- on-policy distillation


def test_distill_advantage_is_each_tokens_discounted_teacher_reward():
    """``r_t = coef * (log pi_teacher - log pi)``, written out by hand for one row with a hole,
    then its return to go for gamma 0 (the token itself) and 0.5, skipping the hole; no baseline."""
    from ppoflow.algos import teacher_rewards

    student = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 0.0]], dtype=F64)
    teacher = torch.tensor([[-0.5, -4.0, -9.0, -1.0, -7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]], dtype=F64)  # a hole at 2, padding at 4
    rewards = teacher_rewards(student, teacher, mask, coef=2.0)
    close(rewards, [[1.0, -4.0, 0.0, 4.0, 0.0]])  # 2 x (t - s) where the mask is 1
    for gamma, want in (
        (0.0, [1.0, -4.0, 0.0, 4.0, 0.0]),
        (0.5, [1.0 - 2.0 + 1.0, -4.0 + 2.0, 0.0, 4.0, 0.0]),
    ):
        adv, ret = compute_advantage("distill", token_level_rewards=rewards, response_mask=mask, gamma=gamma)
        close(adv, [want])
        close(ret, [want])
    # a batch: the same as a plain loop, whatever the other rows hold (nothing is centred)
    gen = torch.Generator().manual_seed(3)
    r, m = randn(gen, 3, 6), random_mask(gen, 3, 6)
    adv, _ = compute_advantage("distill", token_level_rewards=r, response_mask=m, gamma=0.9)
    want = []
    for rr, mr in zip(rows(r), rows(m)):
        g, row = 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            if mr[t]:
                g = rr[t] + 0.9 * g
                row[t] = g
        want.append(row)
    close(adv, want)
