"""A mixture-of-experts policy's router metrics (ppoflow.workers.moe) on tiny Qwen3-MoE and GPT-OSS
models, against transformers' own ``output_router_logits`` forward: its ``aux_loss`` and the expert
shares counted from its router logits. Padded and packed forwards of the same rows agree (the
padding is left out). The metrics of an update on ranks are in tests/scenarios/test_model_matrix.py."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.config import ModelConfig
from ppoflow.workers.hf_models import load_hf_model
from ppoflow.workers.modeling import PolicyLM
from ppoflow.workers.moe import MOE_METRICS, RouterStats
from ppoflow.workers.packing import use_varlen_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[2, 15:] = 0  # right padding
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _shares(router_logits, mask, top_k, experts):
    """Per layer, each expert's share of the real tokens' top-k choices (written out plainly)."""
    keep = mask.reshape(-1).bool()
    out = []
    for layer in router_logits:
        chosen = layer[keep].softmax(-1).topk(top_k, dim=-1).indices.reshape(-1)
        out.append(torch.bincount(chosen, minlength=experts).float() / chosen.numel())
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_router_metrics_equal_transformers_own_router_outputs(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import save_tiny_model

    path = save_tiny_model(str(tmp_path / arch), arch=arch)
    ids, mask, pos = _batch()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    experts, top_k = len(ref.router_logits[0][0]), hf.config.num_experts_per_tok
    want = _shares(ref.router_logits, mask, top_k, experts)

    got = {}
    for packed in (False, True):
        model = load_hf_model(ModelConfig(path=path), "causal_lm")
        if packed:
            use_varlen_attention(model)
        policy = PolicyLM(model)
        router = RouterStats.of(policy)
        assert router is not None and len(router.routers) == 2
        with torch.no_grad(), router.record() as logits:
            policy(ids, mask, pos, ids[:, -5:], mask[:, -5:], packed=packed)
        assert len(logits) == 2
        got[packed] = router.metrics(logits, None if packed else mask)
        assert set(got[packed]) == set(MOE_METRICS)
    for metrics in got.values():
        assert abs(metrics["actor/moe/aux_loss"] - float(ref.aux_loss)) < 1e-5
        assert abs(metrics["actor/moe/load_max"] - float(want.max())) < 1e-6
        assert abs(metrics["actor/moe/load_min"] - float(want.min())) < 1e-6
        entropy = -(want * want.clamp(min=1e-12).log()).sum(-1).mean() / torch.log(torch.tensor(experts))
        assert abs(metrics["actor/moe/load_entropy"] - float(entropy)) < 1e-5
    assert 0 < got[False]["actor/moe/load_min"] <= 1 / experts <= got[False]["actor/moe/load_max"]


def test_a_dense_model_has_no_routers(tmp_path):
    from ppoflow.demo.tiny_models import save_tiny_model

    path = save_tiny_model(str(tmp_path / "dense"), arch="qwen3")
    assert RouterStats.of(PolicyLM(load_hf_model(ModelConfig(path=path), "causal_lm"))) is None
