"""Mini-batches and micro-batches of an update: every row once per epoch, a shuffle that follows the iteration, and gradient accumulation over micro-batches that equals the whole mini-batch's gradient for every loss aggregation and policy loss."""

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


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_grad_accumulation_is_exact_for_every_loss_agg_mode(tiny, mode):
    """Micro-batches of 1 row and of the whole mini-batch give the same gradient (chunk size 5
    splits the LM head into several checkpointed chunks). SGD with lr 1 makes the weight change the
    (clipped) gradient itself, so Adam's amplification of near-zero gradients stays out of it."""
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.loss_agg_mode = mode
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for micro in (1, 16):
        cfg.actor.ppo_micro_batch_size_per_gpu = micro
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        metrics = actor.update_policy(data)
        assert metrics["actor/optimizer_steps"] == 1
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7  # a few fp32 ulps of the weights (|w| < 1)


@pytest.mark.parametrize(
    "loss, mode", [("gspo", "seq-mean-token-mean"), ("gspo_token", "token-mean"), ("cispo", "token-mean")]
)
def test_grad_accumulation_is_exact_for_the_registered_policy_losses(tiny, loss, mode):
    """As above for GSPO (a loss per sequence) and CISPO: 1-row micro-batches = the whole mini-batch,
    and the loss's own metrics reach the update's (GSPO's sequence-ratio statistics)."""
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.policy_loss, cfg.actor.loss_agg_mode = loss, mode
    cfg.actor.clip_ratio_low = cfg.actor.clip_ratio_high = 0.01  # some sequences and tokens clipped
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for micro in (1, 16):
        cfg.actor.ppo_micro_batch_size_per_gpu = micro
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        metrics = actor.update_policy(data)
        assert ("actor/seq_ratio/mean" in metrics) == loss.startswith("gspo")
        assert "actor/pg_clipfrac_high" in metrics and "actor/pg_clipfrac_low" in metrics
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7


def test_mini_batch_rows_cover_every_row_each_epoch():
    from ppoflow.workers.minibatch import mini_batch_rows

    plain = [r.tolist() for r in mini_batch_rows(10, 4, 2, shuffle=False, seed=0)]
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2
    shuffled = [r.tolist() for r in mini_batch_rows(10, 4, 2, shuffle=True, seed=3)]
    epochs = [sum(shuffled[:3], []), sum(shuffled[3:], [])]
    assert all(sorted(e) == list(range(10)) for e in epochs) and epochs[0] != epochs[1]


def test_update_shuffle_follows_the_iteration_not_the_call_count():
    from ppoflow.workers.minibatch import mini_batch_rows, shuffle_seed

    batch = DataProto.from_dict({"x": torch.zeros(10, 1)}, meta_info={"iteration": 7})
    first, retried = shuffle_seed(3, batch, calls=1), shuffle_seed(3, batch, calls=5)
    assert first == retried  # a recomputed or resumed update shuffles as the first one did
    rows = [r.tolist() for r in mini_batch_rows(10, 4, 1, shuffle=True, seed=first)]
    assert rows == [r.tolist() for r in mini_batch_rows(10, 4, 1, shuffle=True, seed=retried)]
    assert (
        shuffle_seed(3, DataProto.from_dict({"x": torch.zeros(10, 1)}, meta_info={"iteration": 8}), 1)
        != first
    )
    unnamed = DataProto.from_dict({"x": torch.zeros(10, 1)})
    assert shuffle_seed(3, unnamed, calls=1) != shuffle_seed(3, unnamed, calls=2)
