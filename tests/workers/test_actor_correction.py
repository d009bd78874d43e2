"""The actor's update with the rollout correction's columns (``rollout_is_weights``,
``rollout_rs_mask``): equal to a plain single-process update written from the objective — with
``mis_normaliser: all`` (IcePop's) each token's policy loss times its weight, a rejected token's
weight 0, every response token in the normaliser and in the entropy and KL terms; with ``kept`` the
rejected tokens left out of the response mask altogether — exact across micro-batch sizes,
identical to the uncorrected update when every ratio is 1, and no optimizer step (no moment, decay
or schedule change) from a mini-batch whose every token was rejected."""

from __future__ import annotations

import pytest
import torch

from ppoflow.algos import agg_loss, compute_policy_loss, kl_penalty, rejection_mask, truncated_is_weights
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    TEMPERATURE,
    make_config,
    max_weight_diff,
    plain_actor,
    plain_log_probs,
)


def _corrected(batch: dict) -> dict:
    """The batch with a sampler whose log-probs are off the trainer's: TIS token weights (cap 1.5)
    and a token-level rejection outside [0.8, 1.25], as the advantage task computes them."""
    g = torch.Generator().manual_seed(5)
    mask = batch["response_mask"]
    sampler = batch["old_log_probs"] + 0.3 * torch.randn(batch["old_log_probs"].shape, generator=g) * mask
    out = dict(batch)
    out["rollout_is_weights"] = truncated_is_weights(batch["old_log_probs"], sampler, mask, "token", 1.5)
    out["rollout_rs_mask"] = rejection_mask(batch["old_log_probs"], sampler, mask, "token", 0.8, 1.25)
    kept = out["rollout_rs_mask"].sum() / mask.sum()
    assert 0.2 < kept < 0.9  # the rejection drops some tokens, not all
    return out


def _sgd_step_reference(model_dir: str, batch: dict, cfg, normaliser: str) -> dict:
    """One SGD step (lr 1) of a plain HF model on the whole batch: each token's policy loss times
    its weight; ``all``: a rejected token's weight 0, every loss over the whole response mask;
    ``kept``: every loss over the response mask without the rejected tokens."""
    from transformers import AutoModelForCausalLM

    a = cfg.actor
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train()
    opt = torch.optim.SGD(hf.parameters(), lr=1.0)
    kept = batch["rollout_rs_mask"]
    if normaliser == "all":
        mask, weights = batch["response_mask"], batch["rollout_is_weights"] * kept
    else:
        mask, weights = batch["response_mask"] * kept, batch["rollout_is_weights"]
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
        rollout_is_weights=weights,
    )
    kl = agg_loss(kl_penalty(logp, batch["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode)
    loss = pg - a.entropy_coeff * agg_loss(entropy, mask, a.loss_agg_mode) + a.kl_loss_coef * kl
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf.parameters(), a.optim.grad_clip)
    opt.step()
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _update(tiny, cfg, batch: dict, micro: int) -> tuple[dict, dict]:
    cfg.actor.ppo_micro_batch_size_per_gpu = micro
    actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
    actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
    data = DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE})
    metrics = actor.update_policy(data)
    assert metrics["actor/optimizer_steps"] == 1
    assert torch.equal(data.batch["response_mask"], batch["response_mask"])  # the caller's batch kept
    return {k: v.detach().clone() for k, v in actor.module.state_dict().items()}, metrics


@pytest.mark.parametrize("normaliser", ["all", "kept"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_corrected_update_matches_the_plain_weighted_masked_step(tiny, mode, normaliser):
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.loss_agg_mode = mode
    cfg.algorithm.rollout_correction.mis_normaliser = normaliser
    batch = _corrected(tiny["batch"])
    one, _ = _update(tiny, cfg, batch, micro=1)
    whole, _ = _update(tiny, cfg, batch, micro=16)
    assert max_weight_diff(one, whole) < 5e-7  # exact accumulation over the corrected mask
    want = _sgd_step_reference(tiny["dir"], batch, cfg, normaliser)
    assert max_weight_diff(whole, want) < 2e-5  # chunked PolicyLM vs a plain full forward, fp32
    other = _sgd_step_reference(tiny["dir"], batch, cfg, "kept" if normaliser == "all" else "all")
    assert max_weight_diff(whole, other) > 1e-4  # the two normalisers are different steps
    plain, _ = _update(tiny, cfg, dict(tiny["batch"]), micro=16)
    assert max_weight_diff(whole, plain) > 1e-4  # the correction changed the step


@pytest.mark.parametrize("normaliser", ["all", "kept"])
def test_a_mini_batch_with_every_token_rejected_takes_no_step(tiny, normaliser):
    """Two mini-batches, the first with every token rejected: AdamW steps once (the second), so
    its moments, its step count, the weight decay and the schedule are those of one step on the
    second mini-batch alone; without the skip the zero gradient would still decay the weights."""
    cfg = make_config(tiny["dir"], mini_batch=4)  # 8 rows per mini-batch, 2 mini-batches
    cfg.actor.entropy_coeff, cfg.actor.use_kl_loss = 0.0, False  # nothing but the policy loss reads tokens
    cfg.algorithm.rollout_correction.mis_normaliser = normaliser
    batch = dict(tiny["batch"])
    kept = batch["response_mask"].clone()
    kept[:8] = 0  # the first mini-batch: every token rejected
    batch["rollout_rs_mask"] = kept
    actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
    before = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    metrics = actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/optimizer_steps"] == 2.0
    steps = {int(s["step"]) for s in actor.optimizer.state.values()}
    assert steps == {1}  # AdamW stepped once
    assert actor.lr_scheduler.last_epoch == 1  # the schedule advanced once
    # the reference: a fresh actor updated on the second mini-batch alone
    second = {k: v[8:] for k, v in batch.items()}
    ref = plain_actor(tiny["dir"], cfg, chunk_size=5)
    ref.update_policy(DataProto.from_dict(second, meta_info={"temperature": TEMPERATURE}))
    got = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    want = {k: v.detach().clone() for k, v in ref.module.state_dict().items()}
    assert max_weight_diff(got, want) < 1e-7
    # and a batch whose every token is rejected leaves the weights as they were
    batch["rollout_rs_mask"] = torch.zeros_like(kept)
    idle = plain_actor(tiny["dir"], cfg, chunk_size=5)
    m = idle.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert m["actor/skipped_steps"] == 2.0 and "actor/pg_loss" not in m
    after = {k: v.detach().clone() for k, v in idle.module.state_dict().items()}
    assert max_weight_diff(before, after) == 0.0 and not idle.optimizer.state


def test_a_correction_of_identical_policies_is_the_uncorrected_update(tiny):
    cfg = make_config(tiny["dir"], mini_batch=8)
    batch = dict(tiny["batch"])
    lp, mask = batch["old_log_probs"], batch["response_mask"]
    same = {
        **batch,
        "rollout_is_weights": truncated_is_weights(lp, lp.clone(), mask, "sequence", 2.0),
        "rollout_rs_mask": rejection_mask(lp, lp.clone(), mask, "geometric", 0.999, 1.001),
    }
    corrected, m1 = _update(tiny, cfg, same, micro=4)
    plain, m2 = _update(tiny, cfg, batch, micro=4)
    assert max_weight_diff(corrected, plain) == 0.0
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"]
