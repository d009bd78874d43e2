"""ppoflow.algos.mismatch against plain loops over tokens written from the equations (Schulman's
k1/k3 KL estimators, NeMo-RL's token_mult_prob_error, perplexities, the shares outside [0.5, 2]),
on ragged masks with empty rows; identical policies measure no mismatch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import mismatch_metrics
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


def ref_mismatch(trainer, sampler, mask, low=0.5, high=2.0) -> dict[str, float]:
    rows = log_ratios_by_row(trainer, sampler, mask)
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
        "kl_k3": sum(math.exp(clamp20(d)) - 1 - clamp20(d) for d in flat) / n,  # E_mu[r - 1 - log r]
        "token_mult_prob_error": sum(math.exp(abs(clamp20(d))) for d in flat) / n,
        "abs_log_ratio_mean": sum(abs(d) for d in flat) / n,
        "abs_log_ratio_max": max(abs(d) for d in flat),
        "ppl_ratio": sum(math.exp(-sum(r) / len(r)) for r in seqs) / len(seqs),
        "trainer_ppl": sum(math.exp(-sum(p) / len(p)) for p in pis if p) / len(seqs),
        "sampler_ppl": sum(math.exp(-sum(m) / len(m)) for m in mus if m) / len(seqs),
        "token_ratio_outside": sum(not low <= math.exp(clamp20(d)) <= high for d in flat) / n,
        "seq_ratio_outside": sum(not low <= math.exp(clamp20(sum(r))) <= high for r in seqs) / len(seqs),
        "geo_ratio_outside": sum(not 0.999 <= math.exp(clamp20(sum(r) / len(r))) <= 1.001 for r in seqs)
        / len(seqs),
    }


@SETTINGS
@given(**SHAPES, spread=st.sampled_from([0.0, 0.05, 0.5, 3.0]))
def test_mismatch_metrics_match_the_equations(seed, batch, length, spread):
    trainer, sampler, mask = log_prob_pair(seed, batch, length, spread)
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
    assert m["geo_ratio_outside"] == pytest.approx(1 / 2)  # the first's geometric mean is 1; 3 is out
    assert m["token_mult_prob_error"] == pytest.approx((2 + 2 + 1 + 3) / 4)
    assert m["abs_log_ratio_max"] == pytest.approx(math.log(3.0))
