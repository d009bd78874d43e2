"""ppoflow.algos.masked: masked reductions against plain-Python loops."""

from __future__ import annotations

import torch
from hypothesis import given

from ppoflow.algos import (
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
    ref_mean,
    ref_var,
    ref_whiten,
    rows,
    valid_values,
)


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
