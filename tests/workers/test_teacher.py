"""The teacher on the actor's side: the actor's update with the teacher's KL as a loss term
(``actor.teacher_kl_coef``) equals a plain single-process step written from the objective —
policy loss, entropy bonus, the reference's KL and ``coef x KL(policy || teacher)`` per token,
each aggregated as the policy loss — exact across micro-batch sizes, and a different step from
the one without it; and the role flag that gives a worker its teacher. (The teacher built on the
actor group's ranks, its log-probs against a plain forward of the teacher model, in a flow:
tests/scenarios/test_flow_distill.py.)"""

from __future__ import annotations

import pytest
import torch

from ppoflow.algos import agg_loss, compute_policy_loss, kl_penalty
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.teacher import split_teacher_role
from tests.support.fsdp.ppo_reference import (
    TEMPERATURE,
    make_config,
    max_weight_diff,
    plain_actor,
    plain_log_probs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_teacher(batch: dict) -> dict:
    """The batch with a teacher's log-probs: the old ones moved by noise (a teacher that disagrees)."""
    g = torch.Generator().manual_seed(11)
    mask = batch["response_mask"]
    return {
        **batch,
        "teacher_log_prob": (batch["old_log_probs"] + torch.randn(mask.shape, generator=g)) * mask,
    }


def _sgd_step_reference(model_dir: str, batch: dict, cfg) -> dict:
    """One SGD step (lr 1) of a plain HF model on the whole batch, the loss written out."""
    from transformers import AutoModelForCausalLM

    a = cfg.actor
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train()
    opt = torch.optim.SGD(hf.parameters(), lr=1.0)
    mask = batch["response_mask"]
    logp, entropy = plain_log_probs(hf, batch, grad=True)
    pg, _, _, _ = compute_policy_loss(
        batch["old_log_probs"],
        logp,
        batch["advantages"],
        mask,
        a.clip_ratio_low,
        a.clip_ratio_high,
        a.clip_ratio_c,
        a.loss_agg_mode,
    )
    ref_kl = agg_loss(kl_penalty(logp, batch["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode)
    half_sq = 0.5 * (logp - batch["teacher_log_prob"]) ** 2  # k2, written out
    teacher_kl = agg_loss(half_sq, mask, a.loss_agg_mode)
    loss = pg - a.entropy_coeff * agg_loss(entropy, mask, a.loss_agg_mode) + a.kl_loss_coef * ref_kl
    loss = loss + a.teacher_kl_coef * teacher_kl
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), a.optim.grad_clip)
    opt.step()
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _update(model_dir: str, cfg, batch: dict, micro: int) -> tuple[dict, dict]:
    cfg.actor.ppo_micro_batch_size_per_gpu = micro
    actor = plain_actor(model_dir, cfg, chunk_size=5)
    actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
    metrics = actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert metrics["actor/optimizer_steps"] == 1
    return {k: v.detach().clone() for k, v in actor.module.state_dict().items()}, metrics


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_teacher_kl_term_is_the_plain_step_of_its_objective(tiny, mode):
    cfg = make_config(tiny["dir"], mini_batch=8)  # one mini-batch of 16 rows
    cfg.actor.loss_agg_mode = mode
    cfg.actor.teacher_kl_coef, cfg.actor.teacher_kl_type = 0.5, "k2"
    batch = _with_teacher(tiny["batch"])
    one, metrics = _update(tiny["dir"], cfg, batch, micro=1)
    whole, _ = _update(tiny["dir"], cfg, batch, micro=16)
    assert max_weight_diff(one, whole) < 5e-7  # exact accumulation over micro-batches
    want = _sgd_step_reference(tiny["dir"], batch, cfg)
    assert max_weight_diff(whole, want) < 2e-5  # chunked PolicyLM vs a plain full forward, fp32
    # the metric is the aggregated k2 at the weights before the step
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32).eval()
    logp, _ = plain_log_probs(hf, batch)
    kl = agg_loss(0.5 * (logp - batch["teacher_log_prob"]) ** 2, batch["response_mask"], mode)
    assert metrics["actor/teacher_kl_loss"] == pytest.approx(kl.item(), rel=1e-4)
    # without the term (coefficient 0, the column ignored) the step is another one
    cfg.actor.teacher_kl_coef = 0.0
    plain, plain_metrics = _update(tiny["dir"], cfg, batch, micro=16)
    assert max_weight_diff(whole, plain) > 1e-4 and "actor/teacher_kl_loss" not in plain_metrics


def test_the_teacher_flag_is_a_suffix_of_the_role():
    config = {"config": {}, "role": "actor_rollout_ref+teacher"}
    plain, flagged = split_teacher_role(config)
    assert flagged and plain == {"config": {}, "role": "actor_rollout_ref"}
    assert config["role"] == "actor_rollout_ref+teacher"  # the caller's dict is not changed
    assert split_teacher_role({"config": {}, "role": "actor_ref"}) == (
        {"config": {}, "role": "actor_ref"},
        False,
    )
    assert split_teacher_role({"config": {}}) == ({"config": {}}, False)
