"""Small experiment configs the tests build, and the dotted-key overrides they take."""

from __future__ import annotations

from typing import Any

from ppoflow.infra.config import ExperimentConfig, apply_overrides, parse_config

#: Overrides that leave a flow run with one worker group (the actor): no critic, no reward model,
#: no KL term (GRPO advantages from the rule reward).
LIGHT = {
    "critic.enable": False,
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "reward.reward_model.enable": False,
}

#: ``LIGHT`` with transformers generating on the actor's own module (``rollout.engine: hf``), for
#: scenarios whose claims are not about the rollout engine: the group starts without vLLM, in about
#: half the time.
LIGHT_HF = {**LIGHT, "rollout.engine": "hf"}


def make_config(tmp_path: Any, model: str, files: list[str], **over: Any) -> ExperimentConfig:
    """A 2-rank config on ``model`` and ``files`` under ``tmp_path/runs``, prompts <= 16 tokens;
    ``over``: dotted-key overrides (``**{"data.truncation": "error"}``)."""
    data: dict[str, Any] = {
        "model": {"path": model},
        "data": {"train_files": files, "train_batch_size": 4},
        "rollout": {"prompt_length": 16},
        "actor": {"ppo_mini_batch_size": 4},
        "critic": {"ppo_mini_batch_size": 4},
        "storage": {"root": str(tmp_path / "runs"), "experiment": "exp"},
        "resources": {"nprocs": 2},
    }
    return parse_config(apply_overrides(data, over))


def slots_config(device: str = "cpu", nprocs: int = 2) -> ExperimentConfig:
    """A config whose only use is asking for ``nprocs`` device slots of ``device``."""
    return parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["x.parquet"], "train_batch_size": 4},
            "actor": {"ppo_mini_batch_size": 4},
            "critic": {"ppo_mini_batch_size": 4},
            "storage": {"root": "/tmp/nowhere", "experiment": "slots"},
            "resources": {"device": device, "nprocs": nprocs},
        }
    )


def tokenizer_of(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def session_config(tmp_path: Any, model: str = "m", **over: Any) -> ExperimentConfig:
    """A GRPO config without a critic on 2 CPU ranks under ``tmp_path/runs`` for tests that open a
    session without training (``model`` need not exist); ``over``: dotted-key overrides."""
    data: dict[str, Any] = {
        "model": {"path": model},
        "data": {"train_files": ["x.parquet"], "train_batch_size": 4},
        "rollout": {"n": 2},
        "actor": {"ppo_mini_batch_size": 4},
        "critic": {"enable": False},
        "algorithm": {"adv_estimator": "grpo"},
        "storage": {"root": str(tmp_path / "runs"), "experiment": "exp"},
        "resources": {"nprocs": 2, "device": "cpu"},
    }
    return parse_config(apply_overrides(data, over))
