"""ppoflow.algos.logits: entropy and log-probs from logits against plain-Python references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    entropy_from_logits,
    logprobs_from_logits,
)
from tests.support.algo_reference import (
    F64,
    SETTINGS,
    close,
    randn,
    ref_entropy,
    ref_logsumexp,
)


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
