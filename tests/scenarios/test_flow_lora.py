"""A LoRA policy through the flow on 2 CPU ranks with vLLM's CPU engine serving the adapter
(``actor.lora.sync: adapter``), GRPO with a KL loss (the reference: the base with adapters off) and
a reward that differs between responses (so every update moves the adapters):

1. two iterations in one flow run commit; the engine's log-probs of what it sampled equal the FSDP
   policy's ``old_log_probs`` within 1e-4 in both iterations (iteration 2 samples from the adapter
   committed by iteration 1); the checkpoints hold only the adapters and their AdamW state;
2. iteration 2 again on a copy rolled back to iteration 1, with a rank killed in ``update_actor``:
   the rebuilt group (base from ``model.path``, adapters from checkpoint 1) commits iteration 2
   equal to the uninterrupted run's, bit for bit;
3. ``ppoflow export-hf --iteration 1`` writes PEFT's adapter directory, and with ``--merge`` a
   merged HF model; both give, in transformers (+ PEFT), the log-probs the FSDP policy of
   iteration 1 computed for iteration 2's rollout (``old_log_probs``), within 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit, copy_experiment

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4
LORA_RUN = {
    "critic.enable": False,
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "reward.reward_model.enable": False,
    "reward.rule": False,
    "reward.custom_function": "tests.support.rewards:digit_share",  # differs between responses
    "actor.use_kl_loss": True,
    "actor.lora.rank": 8,
    "actor.lora.alpha": 16,
    "actor.lora.sync": "adapter",  # the default is merged; this test covers vLLM serving the adapter
    "actor.optim.lr": 1e-2,
    "rollout.calculate_log_probs": True,
}


def _log_probs(model, data: DataProto) -> torch.Tensor:
    """log_softmax(logits / T) of the responses under a transformers model (full forward)."""
    b = data.batch
    r = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    logits = logits[:, -r - 1 : -1].float() / data.meta_info.get("temperature", 1.0)
    return torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def test_lora_flow_commits_resumes_after_a_killed_rank_and_exports(
    prefect_harness, flow_config, flow_assets, tmp_path, monkeypatch, capsys
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ppoflow.cli.main import main
    from ppoflow.flows.ppo import ppo

    cfg = flow_config(str(tmp_path), "lora", **LORA_RUN)
    ppo(cfg, iterations=2)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 2
    for n in (1, 2):
        rollout = DataProto.load(paths.file(n, "rollout.arrow"))
        mask = rollout.batch["response_mask"].bool()
        err = (rollout.batch["rollout_log_probs"] - rollout.batch["old_log_probs"])[mask].abs().max().item()
        assert err < LOGPROB_TOL, (n, err)
        saved = load_full_state_dict(paths.checkpoint("actor", n))
        assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)

    # 2. iteration 2 again from checkpoint 1, a rank killed in update_actor: the same commit
    url = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "resumed", at=1)
    faults.reset()
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:update_actor:1")
    ppo(flow_config(str(tmp_path), "resumed", **LORA_RUN), iterations=1)
    monkeypatch.delenv(faults.ENV_VAR)
    assert_same_commit(cfg.storage.experiment_url, url, 2, roles=("actor",))

    # 3. export iteration 1: adapter directory (PEFT) and merged model (transformers)
    data = DataProto.load(paths.file(2, "rollout.arrow"))  # old_log_probs: the iteration-1 policy
    mask = data.batch["response_mask"].bool()
    want = data.batch["old_log_probs"]
    base = flow_assets["model"]
    adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
    assert main(["export-hf", paths.root, adapter_dir, "--iteration", "1"]) == 0
    assert "PEFT adapter directory" in capsys.readouterr().out
    assert sorted(os.listdir(adapter_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert main(["export-hf", paths.root, merged_dir, "--iteration", "1", "--merge"]) == 0
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    via_peft = _log_probs(PeftModel.from_pretrained(hf_base, adapter_dir).eval(), data)
    via_merged = _log_probs(
        AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval(), data
    )
    base_lp = _log_probs(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), data)
    for got in (via_peft, via_merged):
        assert (got - want)[mask].abs().max().item() < LOGPROB_TOL
    assert (base_lp - want)[mask].abs().max().item() > 100 * LOGPROB_TOL  # the adapter matters
