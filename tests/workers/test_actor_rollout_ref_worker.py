"""ActorRolloutRefWorker on real gloo ranks (ppoflow.infra.remote.driver.group.WorkerGroup), tiny
Qwen2, float32, checked against a single process without FSDP, written plainly here and in
tests/support/fsdp/ppo_reference.py:

- ``compute_log_prob`` (2 ranks) == ``log_softmax(logits / T)`` of a plain HF forward, within 1e-5;
  ``compute_ref_log_prob`` too (after an update: the reference stays frozen); ``generate_sequences``
  (HF engine) recomputes ``old_log_probs`` equal to the engine's own ``rollout_log_probs``;
- one ``update_actor`` (2 mini-batches, micro-batch 3 < mini-batch 4 rows per rank: gradient
  accumulation over unequal micro-batches, entropy bonus, KL loss, grad clipping), with
  ``resources.deterministic`` on, gives the weights of a plain AdamW loop over the same
  mini-batches, within ``WEIGHT_TOL``;
- training uses every rank whatever the rollout engine's tensor parallelism: with vLLM's CPU build
  at TP=2 the engine is one replica over both ranks (dp 1), while every DP_COMPUTE_PROTO method is
  dispatched over both ranks (dp 2). The rollout's ``rollout_log_probs`` (vLLM, TP=2) and the
  ``old_log_probs`` the FSDP actor recomputes (each rank its own half of the rows) both equal the
  plain forward's; one ``update_actor`` on that rollout gives the weights of a plain AdamW loop whose
  optimizer steps each take rows from both ranks' halves. Had the update run on the engine's layout
  (one data shard that both ranks hold whole), its mini-batches would be other rows and the weights
  would differ by far more than the tolerance.

Every check on a group runs in one test to pay the start once. The critic's worker:
tests/workers/test_critic_worker.py.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    ACTOR,
    LOGPROB_TOL,
    TEMPERATURE,
    WEIGHT_TOL,
    P,
    R,
    make_config,
    max_weight_diff,
    mini_batch_groups,
    plain_log_probs,
    reference_actor_update,
    save_batch,
    start_group,
)

pytestmark = pytest.mark.usefixtures("one_thread")

VLLM_LOGPROB_TOL = 1e-4  # vLLM CPU fp32 vs a transformers forward (FIELD-NOTES: within 1.1e-5)
UPDATE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _tp2_config(model_dir: str) -> ExperimentConfig:
    data = make_config(model_dir).model_dump(mode="json")
    data["rollout"].update(
        engine="vllm",
        tensor_model_parallel_size=2,
        kv_cache_gib=0.0625,
        max_num_seqs=16,
        calculate_log_probs=True,
    )
    return ExperimentConfig.model_validate(data)


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
@pytest.mark.cpu_tp
def test_tp2_rollout_then_update_over_both_ranks(tiny):
    from transformers import AutoModelForCausalLM

    cfg = _tp2_config(tiny["dir"])
    tmp = tiny["tmp"]
    prompts = {k: v[::2, :P] for k, v in tiny["batch"].items() if k in UPDATE_KEYS[:3]}  # 8 prompts
    prompts_url = os.path.join(tmp, "tp2-prompts.arrow")
    DataProto.from_dict(prompts, meta_info={"temperature": TEMPERATURE, "seed": 11}).save(prompts_url)
    t0 = time.perf_counter()
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        infos = group.call("init_model")
        engine = [(i["rollout"]["tp_size"], i["rollout"]["dp_size"]) for i in infos]
        assert engine == [(2, 1), (2, 1)], engine  # one TP=2 replica over both ranks
        assert [(e.dp_rank, e.dp_size) for e in group.layout] == [(0, 2), (1, 2)]

        gen = DataProto.load(
            group.call("generate_sequences", prompts_url, out_url=os.path.join(tmp, "tp2-rollout.arrow"))
        )
        assert len(gen) == 8 * cfg.rollout.n
        assert torch.equal(gen.batch["prompts"], prompts["input_ids"].repeat_interleave(cfg.rollout.n, 0))

        g = torch.Generator().manual_seed(3)
        mask = gen.batch["response_mask"]
        batch = {k: gen.batch[k] for k in UPDATE_KEYS}
        batch["old_log_probs"] = gen.batch["old_log_probs"]
        batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
        batch["ref_log_prob"] = (
            gen.batch["old_log_probs"] + 0.3 * torch.randn(mask.shape, generator=g)
        ) * mask
        data_url = save_batch(batch, os.path.join(tmp, "tp2-update.arrow"))
        metrics = group.call("update_actor", data_url)
        ckpt = os.path.join(tmp, "tp2-actor")
        group.call("save_checkpoint", ckpt)
    wall = time.perf_counter() - t0

    hf = AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32).eval()
    want_lp, _ = plain_log_probs(hf, batch)
    m = mask.bool()
    rollout_err = (gen.batch["rollout_log_probs"] - want_lp)[m].abs().max().item()
    old_err = (gen.batch["old_log_probs"] - want_lp)[m].abs().max().item()
    assert rollout_err < VLLM_LOGPROB_TOL, rollout_err
    assert old_err < LOGPROB_TOL, old_err

    per_rank = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // 2  # two data-parallel ranks
    want = reference_actor_update(tiny["dir"], batch, cfg, mini_batch_groups(len(gen), 2, per_rank, 1))
    got = load_full_state_dict(ckpt)
    diff = max_weight_diff(got, want)
    engine_layout = reference_actor_update(
        tiny["dir"], batch, cfg, mini_batch_groups(len(gen), 1, 2 * per_rank, 1)
    )
    other = max_weight_diff(engine_layout, want)
    print(
        f"\ntp2: rollout vs plain {rollout_err:.2e}, old vs plain {old_err:.2e}, weights vs 2-rank reference "
        f"{diff:.2e} (the engine's 1-shard layout would differ by {other:.2e}), {wall:.1f} s"
    )
    assert metrics[0]["actor/optimizer_steps"] == 2
    assert other > 100 * WEIGHT_TOL  # the check can tell the two layouts apart
    assert diff < WEIGHT_TOL
