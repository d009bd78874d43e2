"""The FSDP -> vLLM sharding manager on real torchrun ranks (the ``dp2`` and ``tp2`` scenarios of
tests/support/rollout/vllm_scenario.py, run once per session): after an optimizer step the engine
samples from the live weights, and after ``set_source_checkpoint`` from a 2-rank checkpoint's (into
DP=2 engines while the live weights moved on, and into a TP=2 engine), token for token what
transformers answers on those weights."""

from __future__ import annotations

import pytest

from tests.support.rollout.vllm_scenario import LOGPROB_TOL, lp_diff, responses

pytestmark = pytest.mark.slow


def test_live_push_greedy_matches_transformers(dp2):
    """(a) after an optimizer step and a live push: greedy output = transformers greedy, token for token."""
    out = dp2["after"]
    assert responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert responses(out) != responses(dp2["before"]), "the update did not change the greedy output"
    assert out.meta_info["metrics"]["weight_sync_s"] > 0
    assert dp2["push_after"]["source"] == "live"


def test_checkpoint_push_into_dp_engines(dp2):
    """(b) a checkpoint saved by 2 ranks, pushed into DP=2 engines while the live weights moved on."""
    out = dp2["from_ckpt"]
    assert dp2["push_ckpt"]["source"] == "checkpoint"
    assert responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL


def test_checkpoint_push_into_tp2_engine(tp2, dp2):
    """(b) the 2-rank checkpoint pushed into a TP=2 engine: transformers' greedy output and log-probs."""
    assert [(x["tp_rank"], x["tp_size"], x["dp_size"]) for x in tp2["layout"]] == [(0, 2, 1), (1, 2, 1)]
    out = tp2["from_ckpt"]
    assert responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL
