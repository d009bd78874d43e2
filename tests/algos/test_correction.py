"""ppoflow.algos.correction against plain loops over tokens written from the equations (TIS at
token and sequence level, MIS / IcePop rejection at token, sequence and geometric level), on ragged
masks with empty rows; identical policies change nothing, the update included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    LOSS_AGG_MODES,
    correction_metrics,
    get_policy_loss,
    mismatch_metrics,
    rejection_mask,
    truncated_is_weights,
)
from tests.support.algo_reference import (
    F64,
    SETTINGS,
    SHAPES,
    clamp20,
    log_prob_pair,
    log_ratios_by_row,
    randn,
    random_mask,
)


def ref_tis(trainer, sampler, mask, level, cap) -> list[list[float]]:
    rows = log_ratios_by_row(trainer, sampler, mask)
    out = []
    for i, row in enumerate(rows):
        weights = iter([min(math.exp(clamp20(d)), cap) for d in row] if level == "token" else [])
        seq = min(math.exp(clamp20(sum(row))), cap)
        out.append(
            [
                (next(weights) if level == "token" else seq) if mask[i, t] != 0 else 0.0
                for t in range(mask.shape[1])
            ]
        )
    return out


def ref_keep(trainer, sampler, mask, level, lower, upper) -> list[list[float]]:
    rows = log_ratios_by_row(trainer, sampler, mask)
    out = []
    for i, row in enumerate(rows):
        judged = iter(row)
        seq = {"sequence": clamp20(sum(row)), "geometric": clamp20(sum(row) / len(row)) if row else 0.0}.get(
            level
        )
        keep_row = []
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                keep_row.append(0.0)
                continue
            d = next(judged)
            r = math.exp(clamp20(d) if level == "token" else seq)
            keep_row.append(float(lower <= r <= upper))
        out.append(keep_row)
    return out


@SETTINGS
@given(**SHAPES, level=st.sampled_from(["token", "sequence"]), cap=st.sampled_from([1.0, 1.3, 2.0, 10.0]))
def test_truncated_is_weights_match_the_equation(seed, batch, length, level, cap):
    trainer, sampler, mask = log_prob_pair(seed, batch, length)
    trainer = trainer.requires_grad_(True)
    w = truncated_is_weights(trainer, sampler, mask, level, cap)
    assert not w.requires_grad and w.dtype == torch.float32
    torch.testing.assert_close(
        w.double(), torch.tensor(ref_tis(trainer, sampler, mask, level, cap), dtype=F64)
    )
    m = correction_metrics(mask, weights=w, cap=cap)
    kept = [w[i, t].item() for i in range(batch) for t in range(length) if mask[i, t] != 0]
    if kept:
        assert m["weight_mean"] == pytest.approx(sum(kept) / len(kept))
        assert m["weight_max"] == pytest.approx(max(kept)) and m["weight_max"] <= cap + 1e-6
        assert m["capped_token_share"] == pytest.approx(
            sum(v >= torch.tensor(cap, dtype=torch.float32).item() for v in kept) / len(kept)
        )
    assert m["masked_token_share"] == 0.0


@SETTINGS
@given(
    **SHAPES,
    level=st.sampled_from(["token", "sequence", "geometric"]),
    bounds=st.sampled_from([(0.5, 2.0), (0.9, 1.1), (1.0, 1.0), (0.1, 5.0)]),
)
def test_rejection_mask_matches_the_equation(seed, batch, length, level, bounds):
    trainer, sampler, mask = log_prob_pair(seed, batch, length)
    keep = rejection_mask(trainer, sampler, mask.long(), level, *bounds)
    assert keep.dtype == torch.long
    expected = ref_keep(trainer, sampler, mask, level, *bounds)
    assert keep.tolist() == [[int(v) for v in row] for row in expected]
    m = correction_metrics(mask, kept=keep)
    tokens = int(mask.sum())
    dropped = sum(1 for i in range(batch) for t in range(length) if mask[i, t] != 0 and expected[i][t] == 0)
    assert m["masked_token_share"] == pytest.approx(dropped / tokens if tokens else 0.0)
    rows = [i for i in range(batch) if mask[i].any()]
    gone = [i for i in rows if not any(expected[i])]
    assert m["masked_seq_share"] == pytest.approx(len(gone) / len(rows) if rows else 0.0)
    if level != "token":  # whole sequences: a row is kept or rejected as one
        for i in rows:
            assert len({expected[i][t] for t in range(length) if mask[i, t] != 0}) == 1


def test_identical_policies_get_weight_one_and_lose_nothing():
    trainer, _, mask = log_prob_pair(5, 4, 6)
    trainer = torch.where(mask != 0, trainer, 0.0)
    for level in ("token", "sequence"):
        w = truncated_is_weights(trainer, trainer.clone(), mask, level, cap=2.0)
        assert torch.equal(w, mask.float())
    for level in ("token", "sequence", "geometric"):
        keep = rejection_mask(trainer, trainer.clone(), mask, level, 1.0, 1.0)
        assert torch.equal(keep, mask)
    m = correction_metrics(mask, weights=mask.float(), kept=mask, cap=2.0)
    assert m == {
        "masked_token_share": 0.0,
        "masked_seq_share": 0.0,
        "weight_mean": 1.0,
        "weight_min": 1.0,
        "weight_max": 1.0,
        "capped_token_share": 0.0,
    }


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_a_correction_of_identical_policies_leaves_the_update_unchanged(name, mode):
    """Ratios all 1: the corrected loss and gradient are the uncorrected ones, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    old = randn(gen, 4, 6) - 1.0
    new = (old + 0.1 * randn(gen, 4, 6)).requires_grad_(True)
    adv = randn(gen, 4, 6)
    mask = random_mask(gen, 4, 6)
    mask[0, 0] = 1.0
    w = truncated_is_weights(old, old.clone(), mask, "sequence", cap=2.0)
    keep = rejection_mask(old, old.clone(), mask, "geometric", 0.999, 1.001)
    plain, _ = get_policy_loss(name)(old, new, adv, mask, loss_agg_mode=mode)
    fixed, _ = get_policy_loss(name)(old, new, adv, keep, loss_agg_mode=mode, rollout_is_weights=w)
    assert plain.item() == fixed.item()
    assert torch.equal(torch.autograd.grad(plain, new)[0], torch.autograd.grad(fixed, new)[0])


def test_bad_levels_and_bounds_are_named():
    lp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="unknown truncated IS level 'geometric'"):
        truncated_is_weights(lp, lp, mask, "geometric", 2.0)
    with pytest.raises(ValueError, match="0 < lower <= 1 <= upper"):
        rejection_mask(lp, lp, mask, "token", 1.5, 2.0)
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_metrics(lp, lp[:, :1], mask)
