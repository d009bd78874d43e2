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
    assert "rollout.engine" in text and "unknown rollout engine 'sglang'; allowed: hf, vllm" in text
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


def test_algorithm_names_come_from_the_registries():
    """The config has no list of its own: the allowed names are the algos registries' keys, a newly
    registered estimator is valid at once, and the UI's JSON schema offers the registered names."""
    import torch

    from ppoflow.algos import ADV_ESTIMATORS, KL_PENALTY_KINDS, LOSS_AGG_MODES, register_adv_estimator

    with pytest.raises(ConfigError) as err:
        parse_config(
            _with(algorithm={"adv_estimator": "ppo2", "kl_penalty": "k9"}, actor={"loss_agg_mode": "sum"})
        )
    text = str(err.value)
    assert f"unknown advantage estimator 'ppo2'; allowed: {', '.join(sorted(ADV_ESTIMATORS))}" in text
    assert f"allowed: {', '.join(sorted(KL_PENALTY_KINDS))}" in text and "algorithm.kl_penalty" in text
    assert f"allowed: {', '.join(sorted(LOSS_AGG_MODES))}" in text and "actor.loss_agg_mode" in text

    @register_adv_estimator("test_only_zero")
    def zero(token_level_rewards: torch.Tensor, response_mask: torch.Tensor):
        return torch.zeros_like(token_level_rewards), torch.zeros_like(token_level_rewards)

    try:
        cfg = parse_config(_with(algorithm={"adv_estimator": "test_only_zero"}, critic={"enable": False}))
        assert cfg.algorithm.adv_estimator == "test_only_zero"  # needs no critic: its signature says so
        schema = ExperimentConfig.model_json_schema()["$defs"]["AlgorithmConfig"]["properties"]
        assert schema["adv_estimator"]["enum"] == sorted(ADV_ESTIMATORS)
        assert "test_only_zero" in schema["adv_estimator"]["enum"]
    finally:
        del ADV_ESTIMATORS["test_only_zero"]


def test_a_yaml_syntax_error_names_the_file_the_line_and_the_column(tmp_path):
    import fsspec

    text = "model:\n  path: m\n data: {train_files: [x]}\n"  # 'data' one space off its section
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    with fsspec.open("memory://configs/exp.yaml", "w") as f:
        f.write(text)
    for source in (str(path), "memory://configs/exp.yaml"):
        with pytest.raises(ConfigError) as err:
            load_config(source)
        message = str(err.value)
        assert message.startswith(f"{source}:3:2: not valid YAML")
        assert "     3 |  data: {train_files: [x]}\n       |  ^" in message
        assert "<unicode string>" not in message


@pytest.mark.parametrize(
    "name, suggested",
    [
        ("../escape", "escape"),
        ("a/b", "a-b"),
        ("..", "my-experiment"),
        (".", "my-experiment"),
        (".hidden", "hidden"),
        ("", "my-experiment"),
        ("C:\\runs", "C-runs"),
        ("x" * 129, "x" * 128),
        ("two words", "two-words"),
    ],
)
def test_an_experiment_name_that_is_not_one_plain_component_is_refused_with_the_rule(name, suggested):
    with pytest.raises(ConfigError) as err:
        parse_config(_with(storage={"root": "runs", "experiment": name}))
    text = str(err.value)
    assert "storage.experiment:" in text and f"{name!r} is not a valid experiment name" in text
    assert "letters, digits, '.', '_' and '-', the first a letter or digit" in text  # the rule
    assert f"e.g. {suggested!r}" in text  # and a name that passes it
    parse_config(_with(storage={"root": "runs", "experiment": suggested}))


@pytest.mark.parametrize("name", ["config.yaml", "models", "Data", "MODELS"])
def test_an_experiment_may_not_take_a_name_of_the_roots_own_files(name):
    with pytest.raises(ConfigError, match=rf"storage.experiment: .*{name!r} is a name ppoflow keeps"):
        parse_config(_with(storage={"root": "runs", "experiment": name}))


def test_plain_names_pass_and_the_form_knows_the_rule():
    import re

    from ppoflow.infra.config.names import NAME_PATTERN

    for name in ("exp", "qwen2.5-grpo_1", "a..b", "0", "x" * 128, "data2", "models-v2"):
        assert parse_config(_with(storage={"experiment": name})).storage.experiment_url == f"runs/{name}"
    schema = ExperimentConfig.model_json_schema()["$defs"]["StorageConfig"]["properties"]["experiment"]
    assert schema["pattern"] == f"^{NAME_PATTERN}$"  # the Prefect UI's form checks it too
    assert re.fullmatch(schema["pattern"], "exp") and not re.fullmatch(schema["pattern"], "../exp")


def test_sequence_parallel_checks_name_the_field_and_the_fix():
    packed = {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 48}
    base = {"resources": {"nprocs": 4}, "rollout": {"prompt_length": 32, "response_length": 64}}
    ok = parse_config(
        _with(
            **base,
            actor={**packed, "sequence_parallel_size": 2},
            critic={**packed, "sequence_parallel_size": 4},
        )
    )
    assert ok.actor.sequence_parallel_size == 2 and ok.ref.sequence_parallel_size is None
    cases = [
        ({"actor": {**packed, "sequence_parallel_size": 3}}, "actor.sequence_parallel_size=3 must divide"),
        (
            {"actor": {"use_dynamic_bsz": False, "sequence_parallel_size": 2}},
            "set actor.use_dynamic_bsz=true",
        ),
        (
            {"actor": {**packed, "sequence_parallel_size": 2}, "ref": {"log_prob_use_dynamic_bsz": False}},
            "set ref.log_prob_use_dynamic_bsz=true",
        ),
        # a 96-token row over 2 ranks needs 48 tokens per GPU
        (
            {"actor": {**packed, "ppo_max_token_len_per_gpu": 47, "sequence_parallel_size": 2}},
            "actor.ppo_max_token_len_per_gpu=47 is smaller than the longest row: rollout.prompt_length "
            "+ rollout.response_length = 96 tokens / sequence_parallel_size 2; raise it to at least 48",
        ),
        (
            {"actor": {**packed, "sequence_parallel_size": 2}, "critic": packed},
            "critic.ppo_max_token_len_per_gpu=48 is smaller",
        ),
    ]
    for sections, needle in cases:
        with pytest.raises(ConfigError) as err:
            parse_config(_with(**{**base, **sections}))
        assert needle in str(err.value), (needle, str(err.value))


def test_a_cpu_engines_step_budget_must_hold_its_longest_sequence():
    """On CPU vLLM prefills whole prompts a step (a chunked prefill of a seeded request fails there):
    a step budget below the engine's longest sequence is refused at parse time, naming the fix."""
    rollout = {"prompt_length": 32, "response_length": 64, "max_num_batched_tokens": 95}
    with pytest.raises(ConfigError) as err:
        parse_config(_with(rollout=rollout, evaluation={"response_length": 16}))
    assert (
        "rollout.max_num_batched_tokens=95 is smaller than the engine's longest sequence, 96 tokens"
        in str(err.value)
    )
    with pytest.raises(
        ConfigError, match="raise it or leave it unset"
    ):  # an evaluation's longer responses count
        parse_config(
            _with(rollout={**rollout, "max_num_batched_tokens": 96}, evaluation={"response_length": 128})
        )
    assert (
        parse_config(_with(rollout={**rollout, "max_num_batched_tokens": 96})).rollout.max_num_batched_tokens
        == 96
    )
    on_gpu = _with(rollout=rollout, resources={"device": "cuda"})  # chunked there: any budget
    assert parse_config(on_gpu).rollout.max_num_batched_tokens == 95
