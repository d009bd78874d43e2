"""FSDP workers on real gloo ranks (ppoflow.infra.remote.driver.group.WorkerGroup), tiny Qwen2, float32.

Checked against a single process without FSDP, written plainly here:
- ``compute_log_prob`` (2 ranks) == ``log_softmax(logits / T)`` of a plain HF forward, within 1e-5;
  ``compute_ref_log_prob`` too (after an update: the reference stays frozen); ``generate_sequences``
  (HF engine) recomputes ``old_log_probs`` equal to the engine's own ``rollout_log_probs``;
- one ``update_actor`` (2 mini-batches, micro-batch 3 < mini-batch 4 rows per rank: gradient
  accumulation over unequal micro-batches, entropy bonus, KL loss, grad clipping), with
  ``resources.deterministic`` on, gives the weights of a plain AdamW loop over the same
  mini-batches, within ``WEIGHT_TOL``;
- ``compute_values`` and one ``update_critic`` likewise for the critic.
One group per worker class; every check on a group runs in one test to pay the start once.
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

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_actor_log_prob_and_update_match_single_process(tiny):
    cfg = make_config(tiny["dir"])
    # the update runs under torch's strict deterministic mode (it raises on an op without a
    # deterministic kernel) and must still give the plain loop's weights
    cfg.resources.deterministic = True
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "rollout.arrow"))
    t0 = time.perf_counter()
    prompts_url = save_batch(
        {k: v[::4, :P] for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")},
        str(tmp / "prompts.arrow"),
    )
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        infos = group.call("init_model")
        t_init = time.perf_counter() - t0
        assert infos[0]["actor"]["mesh_shape"] == [2] and infos[0]["actor"]["mesh_dim_names"] == ["fsdp"]
        assert infos[0]["ref"]["mesh_shape"] == [2] and infos[0]["rollout"]["engine"] == "HFRollout"

        # generate (HF engine on the FSDP actor), then old log-probs recomputed by the actor (seed 2.1.3)
        gen = DataProto.load(group.call("generate_sequences", prompts_url))
        assert len(gen) == 4 * cfg.rollout.n and gen.batch["responses"].shape[1] == R
        gmask = gen.batch["response_mask"].bool()
        gen_err = (gen.batch["old_log_probs"] - gen.batch["rollout_log_probs"])[gmask].abs().max().item()
        assert gen_err < LOGPROB_TOL, gen_err

        out = DataProto.load(
            group.call("compute_log_prob", data_url, out_url=str(tmp / "lp.arrow"), calculate_entropy=True)
        )
        hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32)
        want_lp, want_ent = plain_log_probs(hf.eval(), batch)
        mask = batch["response_mask"].bool()
        lp_err = (out.batch["old_log_probs"] - want_lp)[mask].abs().max().item()
        ent_err = (out.batch["entropys"] - want_ent)[mask].abs().max().item()
        assert lp_err < LOGPROB_TOL and ent_err < LOGPROB_TOL, (lp_err, ent_err)
        assert (out.batch["old_log_probs"][~mask] == 0).all()

        metrics = group.call("update_actor", data_url)
        # the reference stays at the base weights after the actor's update
        ref = DataProto.load(group.call("compute_ref_log_prob", data_url)).batch["ref_log_prob"]
        ref_err = (ref - want_lp)[mask].abs().max().item()
        assert ref_err < LOGPROB_TOL, ref_err
        ckpt = str(tmp / "actor_ckpt")
        group.call("save_checkpoint", ckpt, extra={"iteration": 1})
    m = metrics[0]
    assert {k: v for k, v in m.items() if not k.startswith("perf/")} == {
        k: v for k, v in metrics[1].items() if not k.startswith("perf/")
    }
    assert m["actor/optimizer_steps"] == 2 and m["actor/skipped_steps"] == 0
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/kl_loss",
    ):
        assert key in m and m[key] == m[key], key

    groups = mini_batch_groups(16, 2, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    want = reference_actor_update(tiny["dir"], batch, cfg, groups)
    got = load_full_state_dict(ckpt)
    diff = max_weight_diff(got, want)
    moved = max((want[k] - hf.state_dict()[k]).abs().max().item() for k in want)
    print(
        f"\nactor: init {t_init:.1f}s, log-prob err {lp_err:.2e}, entropy err {ent_err:.2e}, rollout vs "
        f"recomputed {gen_err:.2e}, ref err {ref_err:.2e}, "
        f"weight diff {diff:.2e} (update moved weights by up to {moved:.2e}), total {time.perf_counter() - t0:.1f}s"
    )
    assert moved > 1e-3
    assert diff < WEIGHT_TOL


@pytest.mark.slow
def test_critic_values_and_update_match_single_process(tiny):
    # the critic also runs the activation-checkpointing and CPU-offload paths: same numbers expected
    cfg = make_config(tiny["dir"])
    cfg.critic.model = {"path": tiny["dir"], "enable_gradient_checkpointing": True}
    cfg.critic.fsdp.param_offload = True
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "rollout_c.arrow"))
    t0 = time.perf_counter()
    with start_group(CRITIC, cfg, 2) as group:
        infos = group.call("init_model")
        assert infos[1]["critic"]["mesh_shape"] == [2]
        assert infos[1]["critic"]["gradient_checkpointing"] and infos[1]["critic"]["param_offload"]
        values = DataProto.load(group.call("compute_values", data_url)).batch["values"]
        metrics = group.call("update_critic", data_url)
        ckpt = str(tmp / "critic_ckpt")
        group.call("save_checkpoint", ckpt)
    critic = plain_critic(tiny["dir"], cfg.seed).eval()
    mask = batch["response_mask"].bool()
    v_err = (values - plain_values(critic, batch))[mask].abs().max().item()
    assert v_err < LOGPROB_TOL, v_err
    assert (values[~mask] == 0).all()
    m = metrics[0]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in m, key
    assert m["critic/optimizer_steps"] == 2
    groups = mini_batch_groups(16, 2, cfg.critic.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    want = reference_critic_update(tiny["dir"], batch, cfg, groups)
    diff = max_weight_diff(load_full_state_dict(ckpt), want)
    print(f"\ncritic: value err {v_err:.2e}, weight diff {diff:.2e}, total {time.perf_counter() - t0:.1f}s")
    assert diff < WEIGHT_TOL
