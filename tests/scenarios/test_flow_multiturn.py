"""A multi-turn PPO iteration end to end on 2 CPU ranks (transformers' engine, GAE with a critic,
a reward model, a scripted environment): it commits; the advantage batch keeps environment tokens
out of the loss (mask 0, no advantage) and the environment's rewards are its scores; the episode
metrics reach the commit. Then the same iteration on a rolled-back copy with a rank killed in
``generate_sequences``: the retried generate commits the same episodes. Last, multi-turn with a
LoRA actor (``sync: adapter``, vLLM serving the adapter): in both iterations vLLM's log-probs of
the policy's tokens equal the actor's (base + adapter) recomputation over the episodes, so every
turn sampled with the adapter of the iteration."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit, copy_experiment
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow

MULTI_TURN = {
    "rollout.response_length": 24,  # 3 turns of 4 tokens + 2 answers of 6 ("<|user|>obs0<|assistant|>")
    "rollout.multi_turn.enable": True,
    "rollout.multi_turn.environment": "tests.support.multiturn_envs:ScriptedEnv",
    "rollout.multi_turn.max_turns": 3,
    "rollout.multi_turn.max_turn_tokens": 4,
    "rollout.multi_turn.tools": [],
}


def test_multi_turn_iteration_commits_and_a_killed_generate_commits_the_same(
    prefect_harness, flow_config, tmp_path, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    # transformers generates the episodes (the actor's own module): the claims here are the masks,
    # scores and retries of multi-turn, not the engine; vLLM's episodes: the LoRA test below
    cfg = flow_config(str(tmp_path), "multiturn", **MULTI_TURN, **{"rollout.engine": "hf"})
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 1
    metrics = storage.read_json(paths.file(1, "metrics.json"))
    assert metrics["rollout/turns_max"] >= 2 and metrics["rollout/env_tokens_mean"] > 0
    batch = DataProto.load(paths.file(1, "advantages.arrow"))
    mask, turns = batch.batch["response_mask"], batch.batch["turn_ids"]
    env = (turns >= 0) & (mask == 0)  # environment tokens
    assert env.any() and (batch.batch["advantages"][env] == 0).all()
    assert (batch.batch["returns"][env] == 0).all()
    # the scores: the environment's rewards plus the reward model's score on the last policy token
    rm = batch.batch["rm_scores"] * cfg.reward.rm_weight
    assert torch.allclose(batch.batch["token_level_scores"], batch.batch["env_scores"] + rm)
    last_policy = [max(i for i, m in enumerate(row) if m) for row in mask.tolist()]
    assert [int(row.nonzero().max()) for row in batch.batch["rm_scores"]] == last_policy
    assert batch.batch["num_turns"].tolist() == [
        1 + info["index"] % 3 for info in batch.non_tensor_batch["extra_info"]
    ]

    copy = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "multiturn-killed", at=0)
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:generate_sequences:1")
    killed = flow_config(str(tmp_path), "multiturn-killed", **MULTI_TURN, **{"rollout.engine": "hf"})
    state = ppo(killed, iterations=1, return_state=True)
    assert attempts(state)["generate"] == 2
    first = DataProto.load(paths.file(1, "rollout.arrow"))
    again = DataProto.load(ExperimentPaths(copy).file(1, "rollout.arrow"))
    for key in ("responses", "response_mask", "turn_ids", "env_scores"):
        assert torch.equal(again.batch[key], first.batch[key]), key
    assert_same_commit(cfg.storage.experiment_url, copy, 1, roles=("actor",))


def test_multi_turn_with_a_lora_actor_samples_with_its_adapter(prefect_harness, flow_config, tmp_path):
    from ppoflow.flows.ppo import ppo
    from tests.scenarios.test_flow_lora import LORA_RUN

    cfg = flow_config(str(tmp_path), "lora-multiturn", **LORA_RUN, **MULTI_TURN)
    ppo(cfg, iterations=2)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 2
    for n in (1, 2):
        out = DataProto.load(paths.file(n, "rollout.arrow"))
        mask = out.batch["response_mask"].bool()
        assert (out.batch["num_turns"] > 1).any()
        diff = (out.batch["rollout_log_probs"] - out.batch["old_log_probs"])[mask].abs().max()
        assert float(diff) < 1e-4, (n, float(diff))
