"""ppoflow.algos.losses: loss aggregation, PPO's clipped policy loss (dual clip), the value and entropy losses, against references written from the equations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
)
from tests.support.algo_reference import (
    F64,
    SETTINGS,
    SHAPES,
    close,
    randn,
    random_mask,
    ref_agg,
    ref_entropy,
    ref_mean,
    rows,
    valid_values,
)


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
