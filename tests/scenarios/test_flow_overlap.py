"""``algorithm.overlap: one_step`` in the real flow (2 CPU ranks, GAE with a critic, no reward
model, no KL term: two worker groups). Transformers generates on the actor's own module
(``rollout.engine: hf``): the claims are the schedule (which weights each step reads) and the old
log-probs the actor computes, not the engine. (vLLM under one-step overlap:
tests/scenarios/test_flow_mismatch.py.)

Its semantics, checked against independent references:
- iteration k's rollout and old log-probs come from the policy after update k-2 (the base
  weights for k <= 2): the old log-probs of iteration 2 equal a plain transformers forward of the
  base model (and not of checkpoint 1), and each ``generate`` receipt names that checkpoint;
- manifest k records what iteration k+1's data side uses (the checkpoints of k-1);
- deterministic for a given config: 3 iterations in one run commit bit for bit what 1 + 2
  iterations in two runs commit.
"""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths
from tests.support.experiments import assert_same_commit

pytestmark = pytest.mark.slow

OVERLAP = {
    "algorithm.overlap": "one_step",
    "algorithm.use_kl_in_reward": False,
    "reward.reward_model.enable": False,
    "rollout.engine": "hf",
}


def response_log_probs(model_dir: str, weights: dict | None, rollout: DataProto) -> torch.Tensor:
    """Log-probs (B, R) of the rollout's responses under a plain transformers model: the base
    model's weights, or ``weights`` ({hf_name: tensor}) loaded into it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    batch = rollout.batch
    responses = batch["responses"]
    r = responses.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -r - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def test_one_step_overlap_semantics_and_determinism(prefect_harness, flow_config, flow_assets, tmp_path):
    from ppoflow.flows.ppo import ppo

    root = str(tmp_path)
    whole = flow_config(root, "whole", **OVERLAP)
    split = flow_config(root, "split", **OVERLAP)
    assert ppo(whole, iterations=3)["iteration"] == 3
    assert ppo(split, iterations=1)["iteration"] == 1
    assert ppo(split, iterations=2)["iteration"] == 3
    for n in (1, 2, 3):
        assert_same_commit(whole.storage.experiment_url, split.storage.experiment_url, n)

    paths = ExperimentPaths(whole.storage.experiment_url)
    for n, source in ((1, 0), (2, 0), (3, 1)):
        inputs = storage.read_json(paths.receipt(n, "generate"))["inputs"]
        assert inputs["0"] == f"checkpoints/actor/{source:06d}", (n, inputs)
        assert (
            storage.read_json(paths.receipt(n, "values"))["inputs"]["1"] == f"checkpoints/critic/{source:06d}"
        )
    for n, source in ((1, 0), (2, 1), (3, 2)):
        manifest = storage.read_json(paths.file(n, "manifest.json"))
        assert manifest["rollout_checkpoints"] == {
            "actor": f"checkpoints/actor/{source:06d}",
            "critic": f"checkpoints/critic/{source:06d}",
        }

    rollout = DataProto.load(paths.file(2, "rollout.arrow"))
    mask = rollout.batch["response_mask"].bool()
    old = rollout.batch["old_log_probs"][mask]
    base = response_log_probs(flow_assets["model"], None, rollout)[mask]
    after_1 = response_log_probs(
        flow_assets["model"], load_full_state_dict(paths.checkpoint("actor", 1)), rollout
    )[mask]
    diff_base = float((old - base).abs().max())
    diff_1 = float((old - after_1).abs().max())
    print(f"\niteration 2 old log-probs vs the base model: {diff_base:.2e}; vs checkpoint 1: {diff_1:.2e}")
    assert diff_base <= 1e-4, "iteration 2 was sampled and scored with the base weights (update 0)"
    assert diff_1 > 10 * max(diff_base, 1e-6), "... not with checkpoint 1 (the test tells them apart)"
