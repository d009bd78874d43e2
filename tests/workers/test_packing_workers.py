"""Packed token-budget micro-batches (``use_dynamic_bsz``) in the FSDP workers on 2 real gloo
ranks, against the plain single-process references of tests/support/fsdp/ppo_reference.py.

The batch is skewed on purpose: rank 0's share is all full-length rows (P + R tokens), rank 1's
share short ones (a 1-token prompt with a 1-token response, an empty response, ...). With a budget
of one full row, rank 0 needs 4 micro-batches per mini-batch and rank 1 only 1-2: rank 1 must split
its groups to keep FSDP's collectives in step, or the ranks hang. Same tolerances as the padded
tests: LOGPROB_TOL for log-probs/values, WEIGHT_TOL for weights after two AdamW steps (the
critic's with AdamW's fused kernel, the reference's torch's default one).
"""

from __future__ import annotations

import time

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    ACTOR,
    CRITIC,
    LOGPROB_TOL,
    WEIGHT_TOL,
    P,
    R,
    make_config,
    max_weight_diff,
    mini_batch_groups,
    plain_critic,
    plain_log_probs,
    plain_values,
    reference_actor_update,
    reference_critic_update,
    save_batch,
    start_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BUDGET = P + R  # one full-length row


def skewed_batch(batch: dict) -> dict:
    """Rows 0-7 (rank 0) use every position; rows 8-15 (rank 1) are short: row 8 has 1 prompt and
    1 response token, row 9 no response token, rows 10-15 at most 3 prompt + 3 response tokens."""
    b = {k: v.clone() for k, v in batch.items()}
    attn = b["attention_mask"]
    attn[:8] = 1
    for i in range(8, 16):
        p_len, r_len = (1, 1) if i == 8 else (2, 0) if i == 9 else (1 + i % 3, 1 + (i + 1) % 3)
        attn[i] = 0
        attn[i, P - p_len : P + r_len] = 1
    b["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    b["response_mask"] = attn[:, P:].clone()
    for key in ("old_log_probs", "ref_log_prob", "advantages", "values", "returns"):
        b[key] = b[key] * b["response_mask"]
    return b


def packed_config(model_dir: str):
    cfg = make_config(model_dir)
    cfg.rollout.prompt_length, cfg.rollout.response_length = P, R
    cfg.actor.use_dynamic_bsz = True
    cfg.actor.ppo_max_token_len_per_gpu = BUDGET
    cfg.actor.log_prob_max_token_len_per_gpu = 2 * BUDGET
    cfg.critic.use_dynamic_bsz = True
    cfg.critic.ppo_max_token_len_per_gpu = BUDGET
    return cfg


def test_packed_actor_and_ref_match_single_process(tiny):
    cfg = packed_config(tiny["dir"])
    batch, tmp = skewed_batch(tiny["batch"]), tiny["tmp"]
    mask = batch["response_mask"].bool()
    data_url = save_batch(batch, str(tmp / "packed_rollout.arrow"))
    prompts_url = save_batch(
        {k: v[::4, :P] for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")},
        str(tmp / "packed_prompts.arrow"),
    )
    t0 = time.perf_counter()
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        infos = group.call("init_model")
        assert infos[0]["actor"]["attn_implementation"] == "ppoflow_varlen"
        assert infos[0]["ref"]["attn_implementation"] == "ppoflow_varlen"
        assert infos[0]["actor"]["optimizer"] == "for-loop"  # torch's default on CPU
        # the HF engine generates from the varlen-attention actor; old log-probs come packed
        gen = DataProto.load(group.call("generate_sequences", prompts_url))
        gmask = gen.batch["response_mask"].bool()
        gen_err = (gen.batch["old_log_probs"] - gen.batch["rollout_log_probs"])[gmask].abs().max().item()
        assert gen_err < LOGPROB_TOL, gen_err

        out = DataProto.load(
            group.call(
                "compute_log_prob", data_url, out_url=str(tmp / "packed_lp.arrow"), calculate_entropy=True
            )
        )
        metrics = group.call("update_actor", data_url)
        ref = DataProto.load(group.call("compute_ref_log_prob", data_url)).batch["ref_log_prob"]
        ckpt = str(tmp / "packed_actor_ckpt")
        group.call("save_checkpoint", ckpt)
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32)
    want_lp, want_ent = plain_log_probs(hf.eval(), batch)
    lp_err = (out.batch["old_log_probs"] - want_lp)[mask].abs().max().item()
    ent_err = (out.batch["entropys"] - want_ent)[mask].abs().max().item()
    ref_err = (ref - want_lp)[mask].abs().max().item()
    assert lp_err < LOGPROB_TOL and ent_err < LOGPROB_TOL and ref_err < LOGPROB_TOL, (
        lp_err,
        ent_err,
        ref_err,
    )
    assert (out.batch["old_log_probs"][~mask] == 0).all()
    assert metrics[0]["actor/optimizer_steps"] == 2 and metrics[0]["actor/skipped_steps"] == 0
    # rank 0's 4 full rows need 4 micro-batches per step; rank 1's short rows fit one, split to 4
    assert metrics[0]["actor/micro_batches"] == metrics[1]["actor/micro_batches"] == 4

    groups = mini_batch_groups(16, 2, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    want = reference_actor_update(tiny["dir"], batch, cfg, groups)
    diff = max_weight_diff(load_full_state_dict(ckpt), want)
    moved = max((want[k] - hf.state_dict()[k]).abs().max().item() for k in want)
    print(
        f"\npacked actor: log-prob err {lp_err:.2e}, entropy err {ent_err:.2e}, ref err {ref_err:.2e}, "
        f"rollout vs recomputed {gen_err:.2e}, weight diff {diff:.2e} (moved {moved:.2e}), "
        f"{time.perf_counter() - t0:.1f}s"
    )
    assert moved > 1e-3 and diff < WEIGHT_TOL


def test_packed_critic_matches_single_process(tiny):
    cfg = packed_config(tiny["dir"])
    cfg.critic.model = {"path": tiny["dir"], "enable_gradient_checkpointing": True}
    cfg.critic.optim.fused = True  # AdamW's fused kernel on FSDP2's DTensor shards (CPU here)
    batch, tmp = skewed_batch(tiny["batch"]), tiny["tmp"]
    mask = batch["response_mask"].bool()
    data_url = save_batch(batch, str(tmp / "packed_rollout_c.arrow"))
    with start_group(CRITIC, cfg, 2) as group:
        infos = group.call("init_model")
        assert infos[0]["critic"]["gradient_checkpointing"] and infos[0]["critic"]["optimizer"] == "fused"
        values = DataProto.load(group.call("compute_values", data_url)).batch["values"]
        metrics = group.call("update_critic", data_url)
        ckpt = str(tmp / "packed_critic_ckpt")
        group.call("save_checkpoint", ckpt)
    v_err = (
        (values - plain_values(plain_critic(tiny["dir"], cfg.seed).eval(), batch))[mask].abs().max().item()
    )
    assert v_err < LOGPROB_TOL and (values[~mask] == 0).all(), v_err
    assert metrics[0]["critic/optimizer_steps"] == 2
    assert metrics[0]["critic/micro_batches"] == metrics[1]["critic/micro_batches"] == 4
    groups = mini_batch_groups(16, 2, cfg.critic.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    diff = max_weight_diff(
        load_full_state_dict(ckpt), reference_critic_update(tiny["dir"], batch, cfg, groups)
    )
    print(f"\npacked critic (recompute): value err {v_err:.2e}, weight diff {diff:.2e}")
    assert diff < WEIGHT_TOL
