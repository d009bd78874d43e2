"""The packed attention's sliding windows and attention sinks (ppoflow.workers.attention), against
attention written out query by query: each query's keys listed, its softmax taken with the sink's
logit beside the scores. Whole models (Gemma 3, Mistral, Phi-3, GPT-OSS packed against padded, on
ranks) are in tests/scenarios/test_model_matrix.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppoflow.workers.attention import packed_attention, sink_attention, use_varlen_attention, window_mask

TOL = 1e-5


def reference(q, k, v, bounds, window, sinks, scale):
    """(1, T, Hq, D): for every query, the keys of its segment at or before it (the last ``window``
    of them), softmax over their scores (and the head's sink logit, which carries no value)."""
    _, hq, t, d = q.shape
    groups = hq // k.shape[1]
    out = torch.zeros(1, t, hq, d, dtype=torch.float64)
    for s, e in zip(bounds[:-1], bounds[1:]):
        for i in range(s, e):
            lo = s if window is None else max(s, i - window + 1)
            for h in range(hq):
                keys = k[0, h // groups, lo : i + 1].double()
                scores = [float(q[0, h, i].double() @ key) * scale for key in keys]
                logits = scores + ([float(sinks[h])] if sinks is not None else [])
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                values = v[0, h // groups, lo : i + 1].double()
                out[0, i, h] = sum(w / total * val for w, val in zip(weights, values))
    return out.float()


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_packed_windows_and_sinks_equal_attention_written_out(window, with_sinks):
    torch.manual_seed(0)
    bounds = [0, 1, 6, 13]  # a 1-token segment, one shorter and one longer than the window
    t, hq, hkv, d = bounds[-1], 4, 2, 8
    q, k, v = torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    sinks = torch.randn(hq) if with_sinks else None
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = packed_attention(q, k, v, cu, 7, 0.3, sliding_window=window, sinks=sinks)
    want = reference(q, k, v, bounds, window, sinks, 0.3)
    assert got.shape == (1, t, hq, d)
    assert (got - want).abs().max() < TOL


def test_window_mask_and_sinks_take_their_share():
    mask = window_mask(5, 2, "cpu")
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    # one key, value 1: without a sink the output is 1; a sink of logit s leaves 1 / (1 + e^(s - score))
    q, k, v = torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), torch.ones(1, 1, 1, 4)
    out = sink_attention(q, k, v, torch.ones(1, 1, dtype=torch.bool), None, torch.tensor([0.0]))
    assert torch.allclose(out, torch.full_like(out, 0.5))


def test_a_hybrid_model_is_refused_packing():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
    )
    with pytest.raises(ValueError, match="linear_attention layers.*use_dynamic_bsz=false"):
        use_varlen_attention(Qwen3NextForCausalLM(cfg))
