"""Ulysses sequence parallelism (``sequence_parallel_size``) in the FSDP workers on real gloo
ranks, against the plain single-process references of tests/support/fsdp/ppo_reference.py.

Layouts: 2 ranks as one sp group of 2 (dp 1); 4 ranks as 2 x 2 (dp 2 x sp 2, FSDP over all 4);
4 ranks as one sp group of 4. Packed micro-batches of a per-GPU budget of half a full row, so a
micro-batch holds at most one full row and its tokens (prompts and responses of several ragged
rows) are cut across the ranks of a group mid-sequence. The critic runs on a SmolLM2-shaped head
layout (9 query / 3 key-value heads), which sp 2 and 4 do not divide: padded query heads and
repeated key-value heads; the actor on the tiny model's 2 / 1 heads.

Tolerances (fp32): LOGPROB_TOL (1e-5) for log-probs, entropies and values, WEIGHT_TOL (5e-6) for
the weights after two AdamW steps, the same as the unsplit FSDP tests: splitting the tokens only
changes the order of float sums (the gathered gradient, FSDP's reduce-scatter).
"""

from __future__ import annotations

import time

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.packing import first_fit_decreasing
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
from tests.workers.test_packing_workers import skewed_batch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
HALF_ROW = (P + R) // 2  # per-GPU budget: an sp group of 2 packs at most one full row


def sp_config(model_dir: str, nprocs: int, sp: int, critic_dir: str | None = None):
    cfg = make_config(model_dir, nprocs=nprocs)
    cfg.actor.use_dynamic_bsz = cfg.critic.use_dynamic_bsz = True
    cfg.actor.sequence_parallel_size = cfg.critic.sequence_parallel_size = sp
    cfg.actor.ppo_max_token_len_per_gpu = cfg.critic.ppo_max_token_len_per_gpu = HALF_ROW
    cfg.actor.log_prob_max_token_len_per_gpu = cfg.critic.forward_max_token_len_per_gpu = HALF_ROW
    cfg.actor.logprob_chunk_size = 4  # several head chunks per rank
    if critic_dir:
        cfg.critic.model = {"path": critic_dir}
    return cfg


@pytest.fixture(scope="module")
def smol_heads(tmp_path_factory) -> str:
    """A critic base with SmolLM2's head layout: 9 query heads, 3 key-value heads (head_dim 32)."""
    from ppoflow.demo.tiny_models import save_tiny_model

    return save_tiny_model(
        str(tmp_path_factory.mktemp("smol")), seed=3, hidden_size=288, num_heads=9, num_kv_heads=3
    )


def _actor_run(cfg, nprocs: int, batch: dict, tmp, tag: str, role: str, prompts_url: str | None = None):
    """init -> [generate] -> compute_log_prob (+ entropy) -> update_actor -> ref log-probs -> save."""
    data_url = save_batch(batch, str(tmp / f"{tag}_rollout.arrow"))
    out: dict = {}
    with start_group(ACTOR, cfg, nprocs, role=role) as group:
        out["infos"] = group.call("init_model")
        if prompts_url:
            out["gen"] = DataProto.load(group.call("generate_sequences", prompts_url))
        out["lp"] = DataProto.load(group.call("compute_log_prob", data_url, calculate_entropy=True))
        out["metrics"] = group.call("update_actor", data_url)
        if role == "actor_rollout_ref":
            out["ref"] = DataProto.load(group.call("compute_ref_log_prob", data_url)).batch["ref_log_prob"]
        out["ckpt"] = str(tmp / f"{tag}_ckpt")
        group.call("save_checkpoint", out["ckpt"])
    return out


def _check_actor(tiny, cfg, out, batch, dp: int, label: str) -> None:
    mask = batch["response_mask"].bool()
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32)
    want_lp, want_ent = plain_log_probs(hf.eval(), batch)
    got = out["lp"].batch
    errs = {
        "log-prob": (got["old_log_probs"] - want_lp)[mask].abs().max().item(),
        "entropy": (got["entropys"] - want_ent)[mask].abs().max().item(),
    }
    if "ref" in out:
        errs["ref"] = (out["ref"] - want_lp)[mask].abs().max().item()
    assert len(got["old_log_probs"]) == len(batch["responses"])  # one output rank per sp group
    assert (got["old_log_probs"][~mask] == 0).all()
    metrics = out["metrics"]
    assert {m["actor/pg_loss"] for m in metrics} == {metrics[0]["actor/pg_loss"]}  # same on every rank
    assert metrics[0]["actor/optimizer_steps"] == 2 and metrics[0]["actor/skipped_steps"] == 0
    groups = mini_batch_groups(16, dp, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // dp, 1)
    want = reference_actor_update(tiny["dir"], batch, cfg, groups)
    diff = max_weight_diff(load_full_state_dict(out["ckpt"]), want)
    moved = max((want[k] - hf.state_dict()[k]).abs().max().item() for k in want)
    print(
        f"\n{label}: " + ", ".join(f"{k} err {v:.2e}" for k, v in errs.items()) + f", weight diff {diff:.2e}"
    )
    assert max(errs.values()) < LOGPROB_TOL, errs
    assert moved > 1e-3 and diff < WEIGHT_TOL, (moved, diff)


def test_sp2_actor_ref_and_rollout_match_single_process(tiny):
    """2 ranks, one sp group: generation splits the prompts over both ranks and gathers; old
    log-probs, entropies, reference log-probs and the update equal the unsplit computation."""
    cfg = sp_config(tiny["dir"], nprocs=2, sp=2)
    batch, tmp = skewed_batch(tiny["batch"]), tiny["tmp"]
    prompts_url = save_batch(
        {k: v[::4, :P] for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")},
        str(tmp / "sp_prompts.arrow"),
    )
    t0 = time.perf_counter()
    out = _actor_run(cfg, 2, batch, tmp, "sp2", "actor_rollout_ref", prompts_url)
    info = out["infos"][0]["actor"]["sequence_parallel"]
    assert info["sp_size"] == 2 and info["dp_size"] == 1
    assert info["padded_heads"] == 0 and info["kv_repeated"]  # 2 query heads, 1 key-value head
    gen = out["gen"]
    assert len(gen) == 4 * cfg.rollout.n  # the group's 4 prompts, sampled on 2 ranks, kept once
    gmask = gen.batch["response_mask"].bool()
    gen_err = (gen.batch["old_log_probs"] - gen.batch["rollout_log_probs"])[gmask].abs().max().item()
    assert gen_err < LOGPROB_TOL, gen_err
    # a micro-batch holds sp x the per-GPU budget: 2 x 7 tokens, one full row
    lengths = batch["attention_mask"].sum(-1).tolist()
    want_mbs = [len(first_fit_decreasing(lengths[s : s + 8], 2 * HALF_ROW)) for s in (0, 8)]
    assert want_mbs[0] == 8 and out["metrics"][0]["actor/micro_batches"] == sum(want_mbs) / 2
    _check_actor(tiny, cfg, out, batch, dp=1, label=f"sp 2 actor ({time.perf_counter() - t0:.0f}s)")


def test_sp_2x2_actor_matches_single_process(tiny):
    """4 ranks = dp 2 x sp 2, parameters sharded over all 4."""
    cfg = sp_config(tiny["dir"], nprocs=4, sp=2)
    batch, tmp = skewed_batch(tiny["batch"]), tiny["tmp"]
    out = _actor_run(cfg, 4, batch, tmp, "sp2x2", "actor")
    info = out["infos"][0]["actor"]
    assert info["mesh_shape"] == [4] and info["sequence_parallel"]["dp_size"] == 2
    assert [i["actor"]["sequence_parallel"]["sp_rank"] for i in out["infos"]] == [0, 1, 0, 1]
    _check_actor(tiny, cfg, out, batch, dp=2, label="dp 2 x sp 2 actor")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_sp_critic_matches_single_process(tiny, smol_heads, nprocs):
    """One sp group of 2 or 4 ranks on 9 / 3 heads (padded and repeated heads), recompute on."""
    cfg = sp_config(tiny["dir"], nprocs=nprocs, sp=nprocs, critic_dir=smol_heads)
    cfg.critic.model.enable_gradient_checkpointing = True
    batch, tmp = skewed_batch(tiny["batch"]), tiny["tmp"]
    mask = batch["response_mask"].bool()
    data_url = save_batch(batch, str(tmp / f"sp_critic{nprocs}.arrow"))
    with start_group(CRITIC, cfg, nprocs) as group:
        infos = group.call("init_model")
        values = DataProto.load(group.call("compute_values", data_url)).batch["values"]
        metrics = group.call("update_critic", data_url)
        ckpt = str(tmp / f"sp_critic{nprocs}_ckpt")
        group.call("save_checkpoint", ckpt)
    layout = infos[0]["critic"]["sequence_parallel"]
    assert layout["padded_heads"] == (1 if nprocs == 2 else 3) and layout["kv_repeated"]
    v_err = (values - plain_values(plain_critic(smol_heads, cfg.seed).eval(), batch))[mask].abs().max().item()
    assert v_err < LOGPROB_TOL and (values[~mask] == 0).all(), v_err
    assert metrics[0]["critic/optimizer_steps"] == 2
    groups = mini_batch_groups(16, 1, cfg.critic.ppo_mini_batch_size * cfg.rollout.n, 1)
    diff = max_weight_diff(
        load_full_state_dict(ckpt), reference_critic_update(smol_heads, batch, cfg, groups)
    )
    print(f"\nsp {nprocs} critic (9/3 heads): value err {v_err:.2e}, weight diff {diff:.2e}")
    assert diff < WEIGHT_TOL
