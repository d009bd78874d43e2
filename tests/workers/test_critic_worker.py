"""CriticWorker on real gloo ranks (ppoflow.infra.remote.driver.group.WorkerGroup), tiny Qwen2,
float32: ``compute_values`` and one ``update_critic`` (with activation checkpointing and CPU
offload) against a single process without FSDP, written plainly in
tests/support/fsdp/ppo_reference.py. Every check on the group runs in one test to pay the start once."""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    CRITIC,
    LOGPROB_TOL,
    WEIGHT_TOL,
    make_config,
    max_weight_diff,
    mini_batch_groups,
    plain_critic,
    plain_values,
    reference_critic_update,
    save_batch,
    start_group,
)

pytestmark = pytest.mark.usefixtures("one_thread")


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
