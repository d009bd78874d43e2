"""ppoflow.algos.mismatch and ppoflow.algos.correction against plain loops over tokens written from
the equations (Schulman's k1/k3 KL estimators, NeMo-RL's token_mult_prob_error, TIS, MIS/IcePop),
on ragged masks with empty rows; identical policies change nothing."""

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
from tests.support.algo_reference import F64, SETTINGS, SHAPES, randn, random_mask

CLAMP = 20.0


def _case(seed: int, batch: int, length: int, spread: float = 0.5):
    gen = torch.Generator().manual_seed(seed)
    sampler = randn(gen, batch, length) - 2.0
    trainer = sampler + spread * randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    trainer[mask == 0] = float("nan")  # padding is never read
    return trainer, sampler, mask


def _tokens(trainer, sampler, mask) -> list[list[float]]:
    """Per row, the log-ratio d = trainer - sampler of each response token (the equations' input)."""
    return [
        [trainer[i, t].item() - sampler[i, t].item() for t in range(mask.shape[1]) if mask[i, t] != 0]
        for i in range(mask.shape[0])
    ]


def _c(x: float) -> float:
    return min(max(x, -CLAMP), CLAMP)


def ref_mismatch(trainer, sampler, mask, low=0.5, high=2.0) -> dict[str, float]:
    rows = _tokens(trainer, sampler, mask)
    flat = [d for row in rows for d in row]
    seqs = [row for row in rows if row]
    if not flat:
        return {"tokens": 0.0, "kl_k1": 0.0, "kl_k3": 0.0, "token_mult_prob_error": 1.0}
    n = len(flat)
    pis = [
        [trainer[i, t].item() for t in range(mask.shape[1]) if mask[i, t] != 0] for i in range(mask.shape[0])
    ]
    mus = [
        [sampler[i, t].item() for t in range(mask.shape[1]) if mask[i, t] != 0] for i in range(mask.shape[0])
    ]
    return {
        "tokens": float(n),
        "sequences": float(len(seqs)),
        "kl_k1": sum(-d for d in flat) / n,  # E_mu[log mu - log pi]
        "kl_k3": sum(math.exp(_c(d)) - 1 - _c(d) for d in flat) / n,  # E_mu[r - 1 - log r]
        "token_mult_prob_error": sum(math.exp(abs(_c(d))) for d in flat) / n,
        "abs_log_ratio_mean": sum(abs(d) for d in flat) / n,
        "abs_log_ratio_max": max(abs(d) for d in flat),
        "ppl_ratio": sum(math.exp(-sum(r) / len(r)) for r in seqs) / len(seqs),
        "trainer_ppl": sum(math.exp(-sum(p) / len(p)) for p in pis if p) / len(seqs),
        "sampler_ppl": sum(math.exp(-sum(m) / len(m)) for m in mus if m) / len(seqs),
        "token_ratio_outside": sum(not low <= math.exp(_c(d)) <= high for d in flat) / n,
        "seq_ratio_outside": sum(not low <= math.exp(_c(sum(r))) <= high for r in seqs) / len(seqs),
    }


@SETTINGS
@given(**SHAPES, spread=st.sampled_from([0.0, 0.05, 0.5, 3.0]))
def test_mismatch_metrics_match_the_equations(seed, batch, length, spread):
    trainer, sampler, mask = _case(seed, batch, length, spread)
    got = mismatch_metrics(trainer, sampler, mask)
    for key, value in ref_mismatch(trainer, sampler, mask).items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_identical_policies_and_empty_batches_measure_no_mismatch():
    gen = torch.Generator().manual_seed(0)
    lp = randn(gen, 3, 5) - 1.0
    mask = random_mask(gen, 3, 5)
    mask[0, 0] = 1.0
    same = mismatch_metrics(lp, lp.clone(), mask)
    assert same["kl_k1"] == 0.0 and same["kl_k3"] == 0.0 and same["token_mult_prob_error"] == 1.0
    assert same["ppl_ratio"] == 1.0 and same["token_ratio_outside"] == same["seq_ratio_outside"] == 0.0
    assert same["abs_log_ratio_max"] == 0.0 and same["trainer_ppl"] == same["sampler_ppl"]
    empty = mismatch_metrics(lp, lp + 5.0, torch.zeros_like(mask))
    assert empty["tokens"] == 0.0 and empty["token_mult_prob_error"] == 1.0 and empty["kl_k3"] == 0.0
    assert all(math.isfinite(v) for v in empty.values())


def test_a_factor_of_two_is_on_the_band_and_stale_tokens_are_outside():
    sampler = torch.zeros(2, 3, dtype=F64)
    trainer = torch.log(torch.tensor([[2.0, 0.5, 1.0], [3.0, 1.0, 1.0]], dtype=F64))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = mismatch_metrics(trainer, sampler, mask)
    assert m["token_ratio_outside"] == pytest.approx(1 / 4)  # only 3 is outside [0.5, 2]
    assert m["seq_ratio_outside"] == pytest.approx(1 / 2)  # 2 * 0.5 * 1 = 1 is in; 3 is out
    assert m["token_mult_prob_error"] == pytest.approx((2 + 2 + 1 + 3) / 4)
    assert m["abs_log_ratio_max"] == pytest.approx(math.log(3.0))


# ---------------------------------------------------------------------------- corrections


def ref_tis(trainer, sampler, mask, level, cap) -> list[list[float]]:
    rows = _tokens(trainer, sampler, mask)
    out = []
    for i, row in enumerate(rows):
        weights = iter([min(math.exp(_c(d)), cap) for d in row] if level == "token" else [])
        seq = min(math.exp(_c(sum(row))), cap)
        out.append(
            [
                (next(weights) if level == "token" else seq) if mask[i, t] != 0 else 0.0
                for t in range(mask.shape[1])
            ]
        )
    return out


def ref_keep(trainer, sampler, mask, level, lower, upper) -> list[list[float]]:
    rows = _tokens(trainer, sampler, mask)
    out = []
    for i, row in enumerate(rows):
        judged = iter(row)
        seq = {"sequence": _c(sum(row)), "geometric": _c(sum(row) / len(row)) if row else 0.0}.get(level)
        keep_row = []
        for t in range(mask.shape[1]):
            if mask[i, t] == 0:
                keep_row.append(0.0)
                continue
            d = next(judged)
            r = math.exp(_c(d) if level == "token" else seq)
            keep_row.append(float(lower <= r <= upper))
        out.append(keep_row)
    return out


@SETTINGS
@given(**SHAPES, level=st.sampled_from(["token", "sequence"]), cap=st.sampled_from([1.0, 1.3, 2.0, 10.0]))
def test_truncated_is_weights_match_the_equation(seed, batch, length, level, cap):
    trainer, sampler, mask = _case(seed, batch, length)
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
    trainer, sampler, mask = _case(seed, batch, length)
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
    trainer, _, mask = _case(5, 4, 6)
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
