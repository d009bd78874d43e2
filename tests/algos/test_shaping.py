"""ppoflow.algos.shaping: DAPO's overlong penalty, truncated rows and informative groups against
plain loops written from the paper's definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import informative_groups, overlong_penalty, truncated_rows
from tests.support.algo_reference import SETTINGS, close


def ref_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO eq. (13): 0 | ((L_max - L_cache) - |y|) / L_cache | -1."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@SETTINGS
@given(
    l_max=st.integers(1, 40),
    data=st.data(),
    factor=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_overlong_penalty_matches_dapo(l_max, data, factor):
    l_cache = data.draw(st.integers(1, l_max))
    lengths = data.draw(st.lists(st.integers(0, l_max), min_size=1, max_size=8))
    got = overlong_penalty(torch.tensor(lengths), l_max, l_cache, factor)
    close(got, [factor * ref_overlong(n, l_max, l_cache) for n in lengths], tol=1e-6)


def test_overlong_penalty_rejects_a_buffer_outside_the_length():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([3]), 8, 9)


def test_truncated_rows_are_the_full_length_ones():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert truncated_rows(mask, 3).tolist() == [True, False, False, True]


@SETTINGS
@given(groups=st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=4), min_size=1))
def test_informative_groups_are_those_whose_scores_differ(groups):
    labels = [f"p{g}" for g, scores in enumerate(groups) for _ in scores]
    scores = [s for group in groups for s in group]
    order = np.random.default_rng(len(scores)).permutation(len(scores))  # groups interleaved
    got = informative_groups(np.asarray(scores)[order], np.asarray(labels, dtype=object)[order])
    expected = [len(set(groups[int(labels[i][1:])])) > 1 for i in order]
    assert got.tolist() == expected
