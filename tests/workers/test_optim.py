"""The optimizer of a sharded model and the step of the PPO loops: the warm-up schedule, and a non-finite gradient that skips its step (and the schedule's)."""

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


def test_warmup_schedule():
    from ppoflow.infra.config import OptimConfig
    from ppoflow.workers.optim import build_optimizer

    opt, sched = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(lr=1.0, warmup_steps=4))
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_training_steps"):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(warmup_steps_ratio=0.1))


def test_non_finite_grad_norm_skips_the_step(tiny):
    cfg = make_config(tiny["dir"])
    batch = dict(tiny["batch"])
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0, 0] = float("nan")  # a response token of row 0: every step containing it
    actor = plain_actor(tiny["dir"], cfg)
    before = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    metrics = actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/skipped_steps"] == 1
    assert actor.lr_scheduler.last_epoch == 1  # the schedule advances on real steps only
    after = actor.module.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert max_weight_diff(after, before) > 0  # the other mini-batch did step
