"""The experiment config: YAML loading, defaults, and errors that name the field and the fix."""

import pytest

from ppoflow.infra.config import ConfigError, ExperimentConfig, dump_config, load_config, parse_config

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}}


def _with(**sections):
    data = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        data[key] = value
    return data


def test_yaml_round_trip_and_overrides(tmp_path):
    cfg = parse_config(_with(rollout={"n": 4, "engine": "hf"}))
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    again = load_config(str(path), overrides={"actor.optim.lr": 3e-4, "rollout.n": 2})
    assert again.rollout.engine == "hf" and again.rollout.n == 2
    assert again.actor.optim.lr == 3e-4
    assert ExperimentConfig.model_validate(again.model_dump(mode="json")) == again


def test_unknown_field_and_bad_literal_are_named():
    with pytest.raises(ConfigError) as err:
        parse_config(_with(rollout={"engine": "sglang", "nn": 3}))
    text = str(err.value)
    assert "rollout.engine" in text and "'vllm' or 'hf'" in text
    assert "rollout.nn" in text and "Extra inputs are not permitted" in text


@pytest.mark.parametrize(
    "sections, needle",
    [
        ({"resources": {"nprocs": 2}, "actor": {"fsdp": {"fsdp_size": 3}}}, "actor.fsdp.fsdp_size=3"),
        (
            {"resources": {"nprocs": 2}, "rollout": {"tensor_model_parallel_size": 4}},
            "tensor_model_parallel_size=4",
        ),
        ({"critic": {"enable": False}}, "adv_estimator='gae' needs a critic"),
        ({"algorithm": {"adv_estimator": "grpo"}, "critic": {"enable": False}}, "rollout.n >= 2"),
        (
            {"data": {"train_files": ["x"], "train_batch_size": 10}, "actor": {"ppo_mini_batch_size": 4}},
            "multiple of",
        ),
        ({"reward": {"rule": False}}, "no reward source"),
        (
            {
                "resources": {"nprocs": 2},
                "data": {"train_files": ["x"], "train_batch_size": 3},
                "actor": {"ppo_mini_batch_size": 3},
                "critic": {"ppo_mini_batch_size": 3},
            },
            "trained on twice",
        ),
    ],
)
def test_cross_field_rules(sections, needle):
    with pytest.raises(ConfigError, match="invalid config") as err:
        parse_config(_with(**sections))
    assert needle in str(err.value)


def test_hsdp_size_accepted_and_identity():
    cfg = parse_config(_with(resources={"nprocs": 4}, actor={"fsdp": {"fsdp_size": 2}}))
    assert cfg.actor.fsdp.fsdp_size == 2
    assert cfg.identity()["model.path"] == "m" and cfg.critic_model.path == "m"
    other = parse_config(_with(model={"path": "other"}))
    assert other.identity() != cfg.identity()
    assert other.config_hash() != cfg.config_hash()


def test_non_mapping_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(path))
