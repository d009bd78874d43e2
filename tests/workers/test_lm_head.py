"""The LM head's per-token log-probs and entropy a chunk of tokens at a time: equal to a full log-softmax (values and gradients) for both implementations, and the same update either way."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    TEMPERATURE,
    make_config,
    max_weight_diff,
    plain_actor,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_chunked_head_matches_full_log_softmax(impl):
    """Log-probs, entropy and their gradients (hidden, weight, bias) equal autograd through a full
    (N, V) log-softmax, with temperature and an entropy term, for both head implementations."""
    from ppoflow.workers.modeling import chunked_log_probs

    g = torch.Generator().manual_seed(0)
    n, h, v, t = 13, 8, 50, 0.7
    head = torch.nn.Linear(h, v)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def grads(lp, ent):
        head.zero_grad()
        hidden.grad = None
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return (
            [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()],
            lp.detach(),
            ent.detach(),
        )

    logp_all = torch.log_softmax(head(hidden) / t, dim=-1)
    want, want_lp, want_ent = grads(
        logp_all.gather(-1, labels[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)
    )
    got, lp, ent = grads(*chunked_log_probs(hidden, head, labels, t, True, True, chunk_size=5, impl=impl))
    assert (lp - want_lp).abs().max() < 1e-5 and (ent - want_ent).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item())


def test_fused_head_update_equals_checkpointed_head(tiny):
    cfg = make_config(tiny["dir"], mini_batch=8)
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for impl in ("checkpoint", "fused"):
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.module.head_impl = impl
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        actor.update_policy(data)
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7
