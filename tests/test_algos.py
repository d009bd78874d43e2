"""algos: masked reductions, logits helpers, loss aggregation, PPO losses, KL penalties/controllers.

Every check compares against a plain-Python reference written here (floats, loops over rows),
never against the implementation itself. Advantage estimators live in test_algos_advantages.py,
which reuses the helpers at the top of this file.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    LOSS_AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
    get_kl_controller,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from tests.support.algo_reference import (
    F64,
    SETTINGS,
    SHAPES,
    close,
    randn,
    random_mask,
    ref_agg,
    ref_mean,
    ref_var,
    ref_whiten,
    rows,
    valid_values,
)

# ---------------------------------------------------------------- masked reductions


@SETTINGS
@given(**SHAPES)
def test_masked_reductions_match_reference(seed, batch, length):
    gen = torch.Generator().manual_seed(seed)
    values, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    v, m = rows(values), rows(mask)
    flat = valid_values(v, m)
    close(masked_sum(values, mask), sum(flat))
    close(masked_mean(values, mask), ref_mean(flat))
    close(
        masked_mean(values, mask, dim=-1),
        [ref_mean([x for x, k in zip(vr, mr) if k]) for vr, mr in zip(v, m)],
    )
    close(
        masked_sum(values, mask, dim=0),
        [sum(v[b][t] for b in range(batch) if m[b][t]) for t in range(length)],
    )
    close(masked_var(values, mask), ref_var(flat))
    biased = sum((x - ref_mean(flat)) ** 2 for x in flat) / len(flat) if flat else 0.0
    close(masked_var(values, mask, unbiased=False), biased)
    close(masked_whiten(values, mask), ref_whiten(v, m))
    close(masked_whiten(values, mask, shift_mean=False), ref_whiten(v, m, shift_mean=False))


def test_masked_ops_ignore_nan_and_inf_in_padding():
    values = torch.tensor([[1.0, float("nan"), 3.0], [float("inf"), 5.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=F64)
    close(masked_sum(values, mask), 9.0)
    close(masked_mean(values, mask), 3.0)
    close(masked_var(values, mask), 4.0)
    assert torch.isfinite(masked_whiten(values, mask)).all()
    bool_mask = mask.bool()
    close(masked_mean(values, bool_mask), 3.0)


def test_masked_ops_empty_and_single_element():
    values = torch.tensor([[2.0, 7.0]], dtype=F64)
    empty = torch.zeros(1, 2, dtype=F64)
    close(masked_mean(values, empty), 0.0)
    close(masked_mean(values, empty, dim=-1), [0.0])
    close(masked_var(values, empty), 0.0)
    close(masked_whiten(values, empty), [[0.0, 0.0]])
    single = torch.tensor([[0.0, 1.0]], dtype=F64)
    close(masked_var(values, single), 0.0)
    close(masked_whiten(values, single), [[0.0, 0.0]])


# ---------------------------------------------------------------- logits


def ref_logsumexp(zs: list[float]) -> float:
    top = max(zs)
    return top + math.log(sum(math.exp(z - top) for z in zs))


def ref_entropy(zs: list[float]) -> float:
    lse = ref_logsumexp(zs)
    return -sum(math.exp(z - lse) * (z - lse) for z in zs if z != -math.inf)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 3),
    length=st.integers(1, 4),
    vocab=st.integers(1, 12),
)
def test_entropy_and_logprobs_match_reference(seed, batch, length, vocab):
    gen = torch.Generator().manual_seed(seed)
    logits = randn(gen, batch, length, vocab) * 4.0
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    z, lab = logits.tolist(), labels.tolist()
    close(entropy_from_logits(logits), [[ref_entropy(z[b][t]) for t in range(length)] for b in range(batch)])
    expected = [[z[b][t][lab[b][t]] - ref_logsumexp(z[b][t]) for t in range(length)] for b in range(batch)]
    close(logprobs_from_logits(logits, labels), expected)


def test_entropy_is_stable_for_extreme_and_masked_logits():
    logits = torch.tensor([[[1000.0, 0.0, -1000.0], [0.0, -math.inf, 0.0], [5.0, 5.0, 5.0]]], dtype=F64)
    out = entropy_from_logits(logits)
    assert torch.isfinite(out).all()
    close(out, [[0.0, math.log(2.0), math.log(3.0)]])


def test_logprobs_low_precision_rows_in_float32():
    gen = torch.Generator().manual_seed(0)
    logits = (randn(gen, 2, 3, 50) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 50, (2, 3), generator=gen)
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3)
    z = logits.to(F64).tolist()
    expected = [[z[b][t][labels[b, t]] - ref_logsumexp(z[b][t]) for t in range(3)] for b in range(2)]
    torch.testing.assert_close(out.to(F64), torch.tensor(expected, dtype=F64), rtol=1e-2, atol=2e-2)
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels[:, :2])


# ---------------------------------------------------------------- agg_loss


@SETTINGS
@given(**SHAPES, mode=st.sampled_from(LOSS_AGG_MODES))
def test_agg_loss_modes_match_reference(seed, batch, length, mode):
    gen = torch.Generator().manual_seed(seed)
    loss, mask = randn(gen, batch, length), random_mask(gen, batch, length)
    close(agg_loss(loss, mask, mode), ref_agg(rows(loss), rows(mask), mode))


def test_agg_loss_hand_values_and_unknown_mode():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=F64)
    close(agg_loss(loss, mask, "token-mean"), 16.0 / 4)
    close(agg_loss(loss, mask, "seq-mean-token-sum"), (6.0 + 10.0) / 2)
    close(agg_loss(loss, mask, "seq-mean-token-mean"), (2.0 + 10.0) / 2)
    close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), (6.0 / 4 + 10.0 / 4) / 2)
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        agg_loss(loss, mask, "sum")


# ---------------------------------------------------------------- policy loss


def ref_policy_token(old: float, new: float, adv: float, low: float, high: float, c: float):
    """Per-token (loss, clipped?, dual-clipped?) by case analysis."""
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1.0 - low), 1.0 + high)
    loss = max(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_dual = False
    if adv < 0 and loss > -adv * c:
        loss, is_dual = -adv * c, True
    return loss, is_clipped, is_dual


@SETTINGS
@given(
    **SHAPES,
    low=st.floats(0.05, 0.4),
    high=st.floats(0.05, 0.5),
    c=st.floats(1.5, 5.0),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_policy_loss_matches_reference(seed, batch, length, low, high, c, mode):
    gen = torch.Generator().manual_seed(seed)
    old = randn(gen, batch, length) - 2.0
    new = old + randn(gen, batch, length) * 0.8  # ratios from ~0.1 to ~10: every branch is hit
    adv = randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old, new, adv, mask, low, high, c, mode)
    o, n, a, m = rows(old), rows(new), rows(adv), rows(mask)
    per_token = [
        [ref_policy_token(o[b][t], n[b][t], a[b][t], low, high, c) for t in range(length)]
        for b in range(batch)
    ]
    close(pg_loss, ref_agg([[x[0] for x in r] for r in per_token], m, mode))
    close(clipfrac, ref_mean(valid_values([[float(x[1]) for x in r] for r in per_token], m)))
    close(clipfrac_lower, ref_mean(valid_values([[float(x[2]) for x in r] for r in per_token], m)))
    close(
        ppo_kl, ref_mean(valid_values([[o[b][t] - n[b][t] for t in range(length)] for b in range(batch)], m))
    )


# (log-ratio, advantage, expected loss, clipped?, dual-clipped?) with clip 0.2/0.28, c = 3
POLICY_CASES = [
    (math.log(1.1), 1.0, -1.1, False, False),  # inside the trust region
    (math.log(1.5), 1.0, -1.28, True, False),  # A > 0, ratio above 1 + high: clipped at 1.28
    (math.log(0.5), 1.0, -0.5, False, False),  # A > 0, ratio low: pessimistic unclipped term
    (math.log(0.5), -1.0, 0.8, True, False),  # A < 0, ratio below 1 - low: clipped at 0.8
    (math.log(1.5), -1.0, 1.5, False, False),  # A < 0, ratio high but below c: unclipped
    (math.log(5.0), -1.0, 3.0, False, True),  # A < 0, ratio above c: dual clip bounds at 3
    (math.log(5.0), 2.0, -2.56, True, False),  # A > 0 never dual-clipped
    (30.0, -1.0, 3.0, False, True),  # log-ratio clamped to 20 before exp: finite
    (math.log(2.0), 0.0, 0.0, False, False),  # A == 0
]


@pytest.mark.parametrize("log_ratio,adv,expected,is_clipped,is_dual", POLICY_CASES)
def test_policy_loss_clip_cases(log_ratio, adv, expected, is_clipped, is_dual):
    old = torch.tensor([[-1.0]], dtype=F64)
    new = old + log_ratio
    a = torch.tensor([[adv]], dtype=F64)
    mask = torch.ones(1, 1, dtype=F64)
    loss, clipfrac, _, clipfrac_lower = compute_policy_loss(old, new, a, mask, 0.2, 0.28, 3.0)
    close(loss, expected, tol=1e-12)
    close(clipfrac, float(is_clipped))
    close(clipfrac_lower, float(is_dual))


def test_policy_loss_gradient_and_validation():
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    new = torch.tensor([[-0.9, -2.0, 0.5]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=F64)
    loss, *_ = compute_policy_loss(old, new, adv, mask)
    loss.backward()
    # d(-A * ratio)/d(logp) = -A * ratio, averaged over the 2 valid tokens; padding gets no gradient
    close(new.grad, [[-math.exp(0.1) / 2, 1.0 / 2, 0.0]], tol=1e-12)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


# ---------------------------------------------------------------- value and entropy loss


@SETTINGS
@given(**SHAPES, clip=st.one_of(st.none(), st.floats(0.05, 1.0)), mode=st.sampled_from(LOSS_AGG_MODES))
def test_value_loss_matches_reference(seed, batch, length, clip, mode):
    gen = torch.Generator().manual_seed(seed)
    vpreds, returns, values = randn(gen, batch, length), randn(gen, batch, length), randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, clip, mode)
    p, r, v, m = rows(vpreds), rows(returns), rows(values), rows(mask)
    losses, fracs = [], []
    for b in range(batch):
        lrow, frow = [], []
        for t in range(length):
            unclipped = (p[b][t] - r[b][t]) ** 2
            if clip is None:
                clipped = unclipped
            else:
                clipped = (min(max(p[b][t], v[b][t] - clip), v[b][t] + clip) - r[b][t]) ** 2
            lrow.append(max(unclipped, clipped))
            frow.append(1.0 if clipped > unclipped else 0.0)
        losses.append(lrow)
        fracs.append(frow)
    close(vf_loss, 0.5 * ref_agg(losses, m, mode))
    close(vf_clipfrac, ref_mean(valid_values(fracs, m)))


def test_value_loss_hand_case():
    # value 0, clip 0.5, prediction 2, return 1: unclipped 1, clipped (0.5 - 1)^2 = 0.25 -> max 1
    # value 0, clip 0.5, prediction 2, return 3: unclipped 1, clipped 6.25 -> clipped wins
    vpreds = torch.tensor([[2.0, 2.0]], dtype=F64)
    returns = torch.tensor([[1.0, 3.0]], dtype=F64)
    values = torch.zeros(1, 2, dtype=F64)
    loss, frac = compute_value_loss(vpreds, returns, values, torch.ones(1, 2, dtype=F64), 0.5)
    close(loss, 0.5 * (1.0 + 6.25) / 2)
    close(frac, 0.5)


def test_entropy_loss_matches_reference():
    gen = torch.Generator().manual_seed(3)
    logits = randn(gen, 3, 4, 7)
    mask = random_mask(gen, 3, 4)
    ent = [[ref_entropy(zs) for zs in row] for row in logits.tolist()]
    for mode in LOSS_AGG_MODES:
        close(compute_entropy_loss(logits, mask, mode), ref_agg(ent, rows(mask), mode))


# ---------------------------------------------------------------- KL penalty and controllers


def ref_kl(lp: float, ref: float, kind: str) -> float:
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    x = ref - lp
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


@SETTINGS
@given(**SHAPES, kind=st.sampled_from(["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]))
def test_kl_penalty_kinds_match_reference(seed, batch, length, kind):
    gen = torch.Generator().manual_seed(seed)
    logprob, ref = randn(gen, batch, length) * 2, randn(gen, batch, length) * 2
    out = kl_penalty(logprob, ref, kind)
    lp, rf = rows(logprob), rows(ref)
    close(out, [[ref_kl(lp[b][t], rf[b][t], kind) for t in range(length)] for b in range(batch)])


def test_kl_penalty_low_var_clamp_and_unknown_kind():
    logprob = torch.tensor([[-20.0, 0.0, -1.0]], dtype=F64)
    ref = torch.tensor([[0.0, -20.0, -1.0]], dtype=F64)
    out = kl_penalty(logprob, ref, "low_var_kl")
    close(out, [[10.0, 10.0, 0.0]])  # exp(20) - 21 and 19 + exp(-20) both clamp to 10
    assert (kl_penalty(torch.randn(4, 5), torch.randn(4, 5), "k3") >= 0).all()
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logprob, ref, "full")


def test_fixed_kl_controller():
    ctrl = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    for kl in (0.0, 10.0, -3.0):
        ctrl.update(kl, n_steps=64)
        assert ctrl.value == 0.05


def test_adaptive_kl_controller_over_updates():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # kl 9: error 0.5 clipped to 0.2 -> x (1 + 0.2 * 256 / 10000) = x 1.00512
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.100512, rel=1e-12)
    # kl 3: error -0.5 clipped to -0.2 -> x 0.99488
    ctrl.update(current_kl=3.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.09999737856, rel=1e-12)
    # kl 6.6: error 0.1 (inside the clip) -> x (1 + 0.1 * 1000 / 10000) = x 1.01
    ctrl.update(current_kl=6.6, n_steps=1000)
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)
    # kl on target: unchanged
    ctrl.update(current_kl=6.0, n_steps=5000)
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)


def test_get_kl_controller_kinds_and_errors():
    ctrl = get_kl_controller("adaptive", kl_coef=0.2, target_kl=1.0, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2
    ctrl = get_kl_controller("adaptive", init_kl_coef=0.3, target_kl=1.0, horizon=100)
    assert ctrl.value == 0.3
    for kind in ("fixed", "adaptive"):  # one config section serves both kinds
        ctrl = get_kl_controller(kind, kl_coef=0.4, target_kl=1.0, horizon=100)
        assert ctrl.value == 0.4
    with pytest.raises(TypeError):
        get_kl_controller("fixed", kl_coef=0.1, target=1.0)
    with pytest.raises(TypeError):
        get_kl_controller("adaptive", kl_coef=0.1, init_kl_coef=0.1, target_kl=1.0, horizon=10)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_apply_kl_penalty_matches_reference(kind, adaptive):
    gen = torch.Generator().manual_seed(11)
    batch, length = 5, 6
    scores = randn(gen, batch, length)
    old, ref = randn(gen, batch, length), randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    mask[2] = 0.0  # one empty response
    mask[0, 3] = 0.0
    ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=100) if adaptive else FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kind)

    s, o, r, m = rows(scores), rows(old), rows(ref), rows(mask)
    expected, seq_kls = [], []
    for b in range(batch):
        kls = [ref_kl(o[b][t], r[b][t], kind) for t in range(length)]
        expected.append([s[b][t] - 0.1 * kls[t] if m[b][t] else s[b][t] for t in range(length)])
        valid = [k for k, mm in zip(kls, m[b]) if mm]
        if valid:
            seq_kls.append(sum(valid) / len(valid))
    current_kl = sum(seq_kls) / len(seq_kls)
    close(rewards, expected)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    if adaptive:
        err = min(max(current_kl / 0.5 - 1.0, -0.2), 0.2)
        assert ctrl.value == pytest.approx(0.1 * (1.0 + err * batch / 100), rel=1e-12)
    else:
        assert ctrl.value == 0.1
