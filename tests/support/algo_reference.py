"""Plain-Python references and hypothesis settings shared by the algos tests (loops over rows,
floats: never the implementation under test)."""

from __future__ import annotations

import math

import torch
from hypothesis import settings
from hypothesis import strategies as st

F64 = torch.float64
SETTINGS = settings(max_examples=50, deadline=None, database=None)  # no .hypothesis/ example store
SHAPES = dict(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 9))


# ---------------------------------------------------------------- helpers and plain-Python references


def random_mask(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """(B, T) float64 0/1 mask with holes anywhere in a row and, sometimes, whole rows empty."""
    mask = (torch.rand(batch, length, generator=gen) < 0.7).to(F64)
    empty_rows = torch.rand(batch, generator=gen) < 0.15
    mask[empty_rows] = 0.0
    return mask


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def rows(t: torch.Tensor) -> list:
    return t.tolist()


def ref_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def ref_var(xs: list[float]) -> float:
    """Unbiased variance, 0 with fewer than two values."""
    if len(xs) < 2:
        return 0.0
    mu = ref_mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)


def valid_values(values: list[list[float]], mask: list[list[float]]) -> list[float]:
    return [v for vrow, mrow in zip(values, mask) for v, m in zip(vrow, mrow) if m]


def ref_whiten(
    values: list[list[float]], mask: list[list[float]], shift_mean: bool = True
) -> list[list[float]]:
    flat = valid_values(values, mask)
    mu, var = ref_mean(flat), ref_var(flat)
    scale = 1.0 / math.sqrt(var + 1e-8)
    out = []
    for vrow, mrow in zip(values, mask):
        out.append(
            [((v - mu) * scale + (0.0 if shift_mean else mu)) if m else 0.0 for v, m in zip(vrow, mrow)]
        )
    return out


def ref_agg(loss: list[list[float]], mask: list[list[float]], mode: str) -> float:
    if mode == "token-mean":
        return ref_mean(valid_values(loss, mask))
    per_seq = []
    for lrow, mrow in zip(loss, mask):
        vals = [x for x, m in zip(lrow, mrow) if m]
        if not vals:
            continue
        if mode == "seq-mean-token-sum":
            per_seq.append(sum(vals))
        elif mode == "seq-mean-token-mean":
            per_seq.append(sum(vals) / len(vals))
        elif mode == "seq-mean-token-sum-norm":
            per_seq.append(sum(vals) / len(lrow))
    return ref_mean(per_seq)


def close(actual: torch.Tensor | float, expected, tol: float = 1e-9) -> None:
    expected_t = torch.as_tensor(expected, dtype=F64)
    actual_t = torch.as_tensor(actual).to(F64)
    assert actual_t.shape == expected_t.shape, (actual_t.shape, expected_t.shape)
    torch.testing.assert_close(actual_t, expected_t, rtol=tol, atol=tol)


def ref_logsumexp(zs: list[float]) -> float:
    top = max(zs)
    return top + math.log(sum(math.exp(z - top) for z in zs))


def ref_entropy(zs: list[float]) -> float:
    lse = ref_logsumexp(zs)
    return -sum(math.exp(z - lse) * (z - lse) for z in zs if z != -math.inf)


# ---------------------------------------------------------------- sampler vs trainer


def log_prob_pair(seed: int, batch: int, length: int, spread: float = 0.5):
    """``(trainer, sampler, mask)``: (B, T) float64 log-probs of a sampler and a trainer ``spread``
    apart (NaN on padding: never read) and a ragged 0/1 mask with empty rows."""
    gen = torch.Generator().manual_seed(seed)
    sampler = randn(gen, batch, length) - 2.0
    trainer = sampler + spread * randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    trainer[mask == 0] = float("nan")
    return trainer, sampler, mask


def log_ratios_by_row(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Per row, ``d = trainer - sampler`` of each response token, in a plain loop."""
    return [
        [trainer[i, t].item() - sampler[i, t].item() for t in range(mask.shape[1]) if mask[i, t] != 0]
        for i in range(mask.shape[0])
    ]


def clamp20(x: float) -> float:
    """A log-ratio clamped to +-20, as the implementations clamp it before ``exp``."""
    return min(max(x, -20.0), 20.0)
