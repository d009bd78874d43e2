"""LoRA (PEFT adapters) on the policy and the critic, tiny Qwen2, float32.

In process (no ranks):
- a ``PolicyLM`` with adapters (``lora_B`` made non-zero) gives the log-probs of the merged model
  (``merged_weights`` loaded into a plain HF model), and those of PEFT's own ``merge_and_unload``,
  within ``LOGPROB_TOL``; with ``adapters_off`` it gives the base model's;
- the adapter directory ``write_adapter_dir`` writes loads with ``PeftModel.from_pretrained`` and
  gives the same log-probs;
- the config refuses bad LoRA settings with one clear message.

On 2 gloo ranks (slow): ``update_actor`` of the hybrid worker with ``actor.lora`` changes only the
adapters (the reference, the base with adapters off, still equals the HF base model; the trained
log-probs equal base + the checkpoint's adapters through PEFT), the checkpoint holds only the
adapters and their optimizer state, and is a small fraction of a full one; a second group loads it
and gives the same log-probs (resume). The critic's update changes only its adapters and value head.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ppoflow.infra.config import ConfigError, LoRAConfig, apply_overrides, parse_config
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.lora import (
    adapter_tensors,
    adapters_off,
    merged_weights,
    with_adapters,
    write_adapter_dir,
)
from ppoflow.workers.modeling import PolicyLM
from tests.support.fsdp.ppo_reference import (
    ACTOR,
    CRITIC,
    LOGPROB_TOL,
    TEMPERATURE,
    make_config,
    plain_log_probs,
    save_batch,
    start_group,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = LoRAConfig(rank=4, alpha=8.0)


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _policy_log_probs(module: PolicyLM, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return module(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            responses=batch["responses"],
            response_mask=batch["response_mask"],
            temperature=TEMPERATURE,
        )["log_probs"]


def _adapted_policy(model_dir: str) -> PolicyLM:
    torch.manual_seed(0)
    module = with_adapters(PolicyLM, LORA)(_hf(model_dir))
    with torch.no_grad():  # lora_B starts at zero: give the adapters something to say
        for name, p in module.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2)
    return module


def test_lora_log_probs_equal_the_merged_model_and_peft(tiny):
    from peft import PeftModel

    batch, mask = tiny["batch"], tiny["batch"]["response_mask"].bool()
    module = _adapted_policy(tiny["dir"])
    assert all(p.requires_grad == (".lora_" in n) for n, p in module.named_parameters())
    got = _policy_log_probs(module, batch)

    merged = _hf(tiny["dir"])
    tensors = dict(merged_weights(module))
    assert not any("lora" in k or "base_layer" in k for k in tensors)
    merged.load_state_dict(tensors, strict=False)
    want, _ = plain_log_probs(merged, batch)
    base, _ = plain_log_probs(_hf(tiny["dir"]), batch)
    err = (got - want)[mask].abs().max().item()
    moved = (got - base)[mask].abs().max().item()
    assert err < LOGPROB_TOL and moved > 1e-2, (err, moved)

    with adapters_off(module):
        off = _policy_log_probs(module, batch)
    assert (off - base)[mask].abs().max().item() < LOGPROB_TOL
    assert all(p.requires_grad == (".lora_" in n) for n, p in module.named_parameters())

    # PEFT reads the adapter directory and merges it itself: the same log-probs
    out = write_adapter_dir(str(tiny["tmp"] / "adapter"), adapter_tensors(module), LORA, tiny["dir"])
    peft_model = PeftModel.from_pretrained(_hf(tiny["dir"]), out).eval()
    via_peft, _ = plain_log_probs(peft_model, batch)
    via_merge, _ = plain_log_probs(peft_model.merge_and_unload(), batch)
    for other in (via_peft, via_merge):
        assert (got - other)[mask].abs().max().item() < LOGPROB_TOL
    print(f"\nLoRA vs merged: {err:.1e} (the adapters moved log-probs by {moved:.2f})")


@pytest.mark.parametrize(
    "over, message",
    [
        ({"actor.lora.rank": 4, "actor.lora.target_modules": "linear"}, "give 'all-linear' or a list"),
        ({"actor.lora.rank": 4, "actor.lora.target_modules": ["lm_head"]}, "lm_head cannot carry"),
        ({"actor.lora.rank": 4, "actor.lora.target_modules": []}, "empty list"),
        ({"actor.lora.rank": -1}, "greater than or equal to 0"),
        ({"actor.lora.rank": 4, "actor.lora.dropout": 1.0}, "less than 1"),
        ({"actor.lora.rank": 4, "actor.lora.sync": "full"}, "'adapter' or 'merged'"),
        (
            {
                "actor.lora.rank": 4,
                "actor.lora.sync": "adapter",
                "rollout.engine": "vllm",
                "rollout.sleep_level": 2,
            },
            "set rollout.sleep_level to 1",
        ),
        ({"actor.lora.rank": 1024, "rollout.engine": "vllm"}, "rank <= 512"),
        (
            {"critic.lora.rank": 4, "model.use_torch_compile": True},
            "critic.lora with model.use_torch_compile",
        ),
    ],
)
def test_bad_lora_settings_are_refused_with_one_clear_message(over, message):
    data = make_config("m").model_dump(mode="json")
    with pytest.raises(ConfigError, match=message):
        parse_config(apply_overrides(data, over))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.slow
def test_actor_update_trains_only_the_adapters_and_checkpoints_only_them(tiny):
    from peft import PeftModel

    from ppoflow.infra.checkpoint.sharded import load_full_state_dict, read_marker
    from tests.support.experiments import optimizer_tensors

    cfg = make_config(tiny["dir"])
    cfg.actor.lora = LoRAConfig(rank=4, alpha=8.0)
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "lora-rollout.arrow"))
    mask = batch["response_mask"].bool()
    base_lp, _ = plain_log_probs(_hf(tiny["dir"]), batch)
    ckpt = str(tmp / "lora_ckpt")
    t0 = time.perf_counter()
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        info = group.call("init_model")[0]
        assert info["ref"] == {"shared_with": "actor", "adapters": "off"}
        assert 0 < info["actor"]["trainable_params"] < info["actor"]["num_params"] / 10
        before = DataProto.load(group.call("compute_log_prob", data_url)).batch["old_log_probs"]
        metrics = group.call("update_actor", data_url)[0]
        after = DataProto.load(group.call("compute_log_prob", data_url)).batch["old_log_probs"]
        ref = DataProto.load(group.call("compute_ref_log_prob", data_url)).batch["ref_log_prob"]
        group.call("save_checkpoint", ckpt, extra={"iteration": 1})
    # lora_B starts at zero: the policy starts as the base model
    assert (before - base_lp)[mask].abs().max().item() < LOGPROB_TOL
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/grad_norm"] > 0
    assert (after - before)[mask].abs().max().item() > 1e-3  # the update moved the policy
    # the base did not move: the reference (adapters off) still is the HF base model
    assert (ref - base_lp)[mask].abs().max().item() < LOGPROB_TOL

    # the checkpoint: the adapters and their optimizer state, nothing of the base
    saved = load_full_state_dict(ckpt)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]
    opt = optimizer_tensors(ckpt)
    assert opt and all(".lora_A." in k or ".lora_B." in k for k in opt), sorted(opt)[:4]
    assert read_marker(ckpt)["world_size"] == 2
    # base + these adapters, put together by PEFT, is the trained policy
    adapter = {("base_model.model." + k).replace(".default.", "."): v for k, v in saved.items()}
    adapter_dir = write_adapter_dir(str(tmp / "lora-adapter"), adapter, cfg.actor.lora, tiny["dir"])
    peft_lp, _ = plain_log_probs(PeftModel.from_pretrained(_hf(tiny["dir"]), adapter_dir).eval(), batch)
    assert (after - peft_lp)[mask].abs().max().item() < LOGPROB_TOL
    # size: a full checkpoint's tensors are every weight and two AdamW moments of each, in
    # float32; the files around the tensors (marker, DCP metadata, RNG states) are a fixed cost
    full_bytes = 3 * 4 * sum(p.numel() for p in _hf(tiny["dir"]).parameters())
    lora_bytes = sum(t.numel() * t.element_size() for t in [*saved.values(), *opt.values()])
    assert lora_bytes < full_bytes / 10, (lora_bytes, full_bytes)
    assert _dir_bytes(ckpt) < full_bytes / 2

    # resume: a fresh group (1 rank: N -> M) loads the adapters and gives the same log-probs
    cfg.resources.nprocs = 1
    with start_group(ACTOR, cfg, 1, role="actor_rollout_ref") as group:
        group.call("init_model")
        group.call("load_checkpoint", ckpt)
        resumed = DataProto.load(group.call("compute_log_prob", data_url)).batch["old_log_probs"]
    assert (resumed - after)[mask].abs().max().item() < LOGPROB_TOL
    print(
        f"\nLoRA actor: checkpoint tensors {lora_bytes / 1e3:.0f} kB (files {_dir_bytes(ckpt) / 1e3:.0f} kB) "
        f"vs a full one's tensors {full_bytes / 1e3:.0f} kB; "
        f"{time.perf_counter() - t0:.1f}s"
    )


@pytest.mark.slow
def test_critic_update_trains_only_adapters_and_value_head(tiny):
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict

    cfg = make_config(tiny["dir"])
    cfg.critic.lora = LoRAConfig(rank=4, alpha=8.0)
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "lora-critic.arrow"))
    ckpt0, ckpt1 = str(tmp / "critic0"), str(tmp / "critic1")
    with start_group(CRITIC, cfg, 2) as group:
        group.call("init_model")
        group.call("save_checkpoint", ckpt0)
        group.call("update_critic", data_url)
        group.call("save_checkpoint", ckpt1)
    s0, s1 = load_full_state_dict(ckpt0), load_full_state_dict(ckpt1)
    assert set(s0) == set(s1) and "score.weight" in s0
    assert all(".lora_" in k or k.startswith("score.") for k in s0), sorted(s0)[:4]
    changed = {k for k in s0 if not torch.equal(s0[k], s1[k])}
    assert "score.weight" in changed and any(".lora_B." in k for k in changed)
