"""The weight sync between the FSDP actor and vLLM. On the ``dp2`` scenario of
tests/support/rollout/vllm_scenario.py (real ranks, run once per session): after a live push the
tied head is refreshed (vLLM's log-probs equal the actor's; a stale head is off by ~0.3) and a
prompt whose KV was cached before the push follows the new weights. Without ranks: the weight
streams of a plain module and of a checkpoint (one decoder layer at a time) give the module's own
tensors, and what a stream carried is counted."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import save_checkpoint
from ppoflow.workers.rollout.weight_sync import (
    WeightStats,
    checkpoint_weights,
    layer_groups,
    live_weights,
    read_groups,
)
from tests.support.rollout.vllm_scenario import LOGPROB_TOL, LONG, lp_diff, responses


@pytest.mark.slow
def test_live_push_log_probs_match_actor_tied_head(dp2):
    """(a) rollout_log_probs = the actor's old_log_probs within 1e-4 (a stale tied lm_head gives ~0.3)."""
    out = dp2["after"]
    assert lp_diff(out) < LOGPROB_TOL
    assert lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL
    assert "lm_head" in dp2["push_after"]["tied_refreshed"]


@pytest.mark.slow
def test_long_prompt_after_push_uses_new_weights(dp2):
    """(c) the prompt longer than a KV block (cached before the push) follows the new weights."""
    i = [int(m.sum()) for m in dp2["prompts"].batch["attention_mask"]].index(LONG)
    ref = dp2["ref1"].greedy(dp2["prompts"][i : i + 1])[0]
    assert responses(dp2["after"])[i] == ref


def test_names_group_by_decoder_layer_in_order_of_first_appearance():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.10.input_layernorm.weight",
        "model.norm.weight",
    ]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"],
        ["model.layers.1.mlp.up_proj.weight"],
        ["model.layers.10.input_layernorm.weight"],
        ["model.norm.weight"],
    ]


def test_reads_pack_whole_layers_in_order_up_to_the_budget():
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.a",
        "model.layers.0.b",
        "model.layers.1.a",
        "model.layers.2.a",
        "model.norm.weight",
    ]
    nbytes = {"model.embed_tokens.weight": 50, "model.layers.0.a": 20, "model.layers.0.b": 20}
    nbytes |= {"model.layers.1.a": 40, "model.layers.2.a": 100, "model.norm.weight": 1}
    assert read_groups(names, nbytes, budget=100) == [
        ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b"],  # 90 bytes
        ["model.layers.1.a"],  # with layer 2 it would be 140
        ["model.layers.2.a"],  # as large as the budget: a read of its own
        ["model.norm.weight"],
    ]
    assert read_groups(names, nbytes, budget=1) == layer_groups(names)  # one read per layer
    assert read_groups(names, nbytes, budget=10**9) == [names]


def test_the_live_and_checkpoint_streams_give_the_module_s_tensors(tmp_path):
    """A tied tiny Qwen2: the live stream gives each parameter once under its HF name (the tied
    head as ``model.embed_tokens.weight`` only), in the dtype asked; the checkpoint stream of those
    names gives the same tensors, layer by layer; the stats count what went through."""
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import save_tiny_model

    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "tiny"), seed=0))
    params = dict(model.named_parameters())
    live = list(live_weights(model))
    names = [n for n, _ in live]
    assert names == list(params) and "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert all(torch.equal(t, params[n]) for n, t in live)
    assert all(t.dtype == torch.bfloat16 for _, t in live_weights(model, dtype=torch.bfloat16))

    url = save_checkpoint(str(tmp_path / "ckpt"), model)
    stats = WeightStats()
    streamed = list(stats.wrap(checkpoint_weights(url, names)))
    assert [n for n, _ in streamed] == names
    assert all(torch.equal(t, params[n]) for n, t in streamed)
    numel = sum(p.numel() for p in params.values())
    assert stats.as_dict() == {"tensors": len(names), "params": numel, "bytes": 4 * numel}
    by_layer = list(checkpoint_weights(url, names, read_bytes=1))  # one read per decoder layer
    assert [n for n, _ in by_layer] == names and all(torch.equal(t, params[n]) for n, t in by_layer)
    everything = dict(checkpoint_weights(url))  # no names: every model tensor, the tied head too
    assert set(everything) == set(names) | {"lm_head.weight"}
    assert torch.equal(everything["lm_head.weight"], params["model.embed_tokens.weight"])
