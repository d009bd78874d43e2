"""TP slicing of live pushes (the dtensor_weight_loader): on the ``tp2`` scenario of
tests/support/rollout/vllm_scenario.py, each TP rank of one engine receives only its slices and the
engine then answers what transformers does; and what a slice spec covers of a tensor."""

from __future__ import annotations

import pytest
import torch

from ppoflow.workers.rollout.tp_slicing import _region
from tests.support.rollout.vllm_scenario import LOGPROB_TOL, lp_diff, responses


@pytest.mark.slow
def test_live_push_sliced_into_tp2_engine(tp2, dp2):
    """Live push through the dtensor_weight_loader: correct output, and each TP rank got less than
    every full tensor (only its slices of the linear layers)."""
    out = tp2["live"]
    assert responses(out) == tp2["ref3"].greedy(dp2["prompts"])
    assert lp_diff(out) < LOGPROB_TOL
    full = tp2["push_ckpt"][0]["last_push"]["bytes"]
    for rank in tp2["push_live"]:
        assert rank["last_push"]["source"] == "live"
        assert rank["last_push"]["bytes"] < 0.8 * full, (rank["last_push"]["bytes"], full)


def test_a_slice_spec_covers_one_dimension_s_range():
    """``(dim, start, size)``: rows of a column-parallel weight, columns of a row-parallel one;
    dim -1 (a tensor that is not sliced) covers the whole tensor."""
    shape = torch.Size([8, 6])
    assert _region([0, 4, 4], shape) == [(4, 8), (0, 6)]
    assert _region([1, 0, 3], shape) == [(0, 8), (0, 3)]
    assert _region([-1, 0, 0], shape) == [(0, 8), (0, 6)]
