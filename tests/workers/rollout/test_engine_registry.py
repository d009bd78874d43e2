"""ppoflow.workers.rollout's builders resolve an engine from the registry alone: a toy engine
registered in the test (``tests.support.toy_engine``, no branch of its own anywhere) is built with
its manager, runs multi-turn episodes, and its capabilities steer the rank code (log-probs it
always returns are kept; without that capability, only when the config asks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppoflow.infra.config import parse_config
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.rollout import build_rollout, build_sharding_manager
from ppoflow.workers.rollout.sharding_manager import NoOpShardingManager
from tests.support.toy_engine import ToyRollout, register_toy

P, R = 12, 10


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from ppoflow.demo.tiny_models import save_tiny_model

    return AutoTokenizer.from_pretrained(save_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=0))


def _config(multi_turn: bool, calculate_log_probs: bool = False):
    rollout = {
        "engine": "toy",
        "prompt_length": P,
        "response_length": R,
        "calculate_log_probs": calculate_log_probs,
    }
    if multi_turn:
        rollout["multi_turn"] = {
            "enable": True,
            "environment": "tests.support.multiturn_envs:ScriptedEnv",
            "max_turns": 3,
            "max_turn_tokens": 2,
            "tools": [],
        }
    return parse_config({"model": {"path": "m"}, "data": {"train_files": ["d"]}, "rollout": rollout})


def _prompts(n: int = 2) -> DataProto:
    ids = torch.full((n, P), 0, dtype=torch.long)
    mask = torch.zeros((n, P), dtype=torch.long)
    ids[:, -2:], mask[:, -2:] = torch.tensor([[40, 41 + i] for i in range(n)]), 1
    extra = np.array([{"index": i, "turns": 2} for i in range(n)], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"extra_info": extra})


def _build(cfg, tokenizer):
    rollout = build_rollout(
        cfg, model_path="m", tokenizer=tokenizer, actor_module=None, device="cpu", rank=0, world_size=1
    )
    return rollout, build_sharding_manager(rollout, None, loader="hf", sleep_level=1)


def test_a_registered_engine_is_built_with_its_manager(monkeypatch, tokenizer):
    spec = register_toy(monkeypatch)
    rollout, manager = _build(_config(multi_turn=False), tokenizer)
    assert isinstance(rollout, ToyRollout) and rollout.spec is spec
    assert isinstance(manager, NoOpShardingManager)  # the spec's manager, resolved from its import path
    with manager:
        out = rollout.generate_sequences(_prompts())
    assert out.batch["responses"].tolist() == [[41] * R, [42] * R]  # the toy's own rule


def test_its_capabilities_steer_multi_turn_episodes(monkeypatch, tokenizer):
    """Two-turn episodes on the toy: each policy turn is the context's last token twice (the toy's
    rule); the engine's log-probs are kept because it declares always_log_probs, and dropped when
    a spec without it is registered (and the config does not ask for them)."""
    register_toy(monkeypatch)
    rollout, manager = _build(_config(multi_turn=True), tokenizer)
    assert type(rollout).__name__ == "MultiTurnRollout" and isinstance(rollout.engine, ToyRollout)
    with manager:
        out = rollout.generate_sequences(_prompts())
    assert rollout.engine.turns == [2, 2]  # both episodes, two turns
    mask = out.batch["response_mask"].bool()
    for row in range(2):
        policy = out.batch["responses"][row][mask[row]].tolist()
        assert len(policy) == 4 and policy[0] == policy[1] and policy[2] == policy[3], policy
    assert out.batch["num_turns"].tolist() == [2, 2]
    assert "rollout_log_probs" in out.batch and out.batch["rollout_log_probs"][mask].abs().sum() == 0

    register_toy(monkeypatch, capabilities=frozenset({"multi_turn"}))
    rollout, manager = _build(_config(multi_turn=True), tokenizer)
    with manager:
        assert "rollout_log_probs" not in rollout.generate_sequences(_prompts()).batch
    rollout, manager = _build(_config(multi_turn=True, calculate_log_probs=True), tokenizer)
    with manager:
        assert "rollout_log_probs" in rollout.generate_sequences(_prompts()).batch
