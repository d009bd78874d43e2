"""The transformers rollout (``rollout.engine: hf``): on the ``dp2`` scenario of
tests/support/rollout/vllm_scenario.py, generate on the FSDP module itself samples what transformers
answers, with the actor's log-probs; and each response ends at its first stop token."""

from __future__ import annotations

import pytest
import torch

from ppoflow.workers.rollout.hf_rollout import _cut_at_eos
from tests.support.rollout.vllm_scenario import LOGPROB_TOL, lp_diff, responses


@pytest.mark.slow
def test_hf_rollout_engine(dp2):
    """rollout.engine=hf: transformers generate on the FSDP module itself (no sync), same checks."""
    greedy, sampled = dp2["hf_greedy"], dp2["hf_sampled"]
    assert responses(greedy) == dp2["ref1"].greedy(dp2["prompts"])
    assert lp_diff(greedy) < LOGPROB_TOL
    assert lp_diff(sampled) < LOGPROB_TOL
    assert sampled.meta_info["temperature"] == 0.7 and len(sampled) == 8
    resp = responses(sampled)
    assert any(resp[2 * i] != resp[2 * i + 1] for i in range(4))
    assert resp[:4] != resp[4:], "the two ranks sampled the same responses for the same prompts"
    assert greedy.meta_info["metrics"]["weight_sync_s"] == 0.0


def test_responses_end_at_their_first_stop_token():
    """Tokens and log-probs up to and including the first stop token (of one id or several); a
    row without one ran to the length limit and keeps everything."""
    gen = torch.tensor([[5, 0, 6, 0], [5, 6, 7, 8], [9, 3, 0, 0]])
    lp = -torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4
    assert _cut_at_eos(gen, lp, 0) == (
        [[5, 0], [5, 6, 7, 8], [9, 3, 0]],
        [[0.0, -0.25], [-1.0, -1.25, -1.5, -1.75], [-2.0, -2.25, -2.5]],
    )
    assert _cut_at_eos(gen, lp, [3, 7])[0] == [[5, 0, 6, 0], [5, 6, 7], [9, 3]]
    assert _cut_at_eos(gen, lp, None)[0] == gen.tolist()
