"""Named recipes fill in their settings under the config; DAPO's settings are checked early."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ConfigError, ExperimentConfig, parse_config

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}, "rollout": {"n": 4}}

# what each recipe must mean, written from the papers (not from the recipe table)
EXPECTED = {
    "ppo": {"algorithm.adv_estimator": "gae", "critic.enable": True, "actor.policy_loss": "vanilla"},
    "grpo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": True,
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.use_kl_loss": True,
        "critic.enable": False,
    },
    "grpo_token_mean": {"algorithm.adv_estimator": "grpo", "actor.loss_agg_mode": "token-mean"},
    "dr_grpo": {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": False,
        "actor.loss_agg_mode": "seq-mean-token-sum-norm",
        "actor.use_kl_loss": False,
    },
    "dapo": {
        "actor.clip_ratio_low": 0.2,
        "actor.clip_ratio_high": 0.28,
        "actor.loss_agg_mode": "token-mean",
        "algorithm.dynamic_sampling.enable": True,
        "reward.overlong_buffer.enable": True,
        "actor.use_kl_loss": False,
    },
    "gspo": {
        "actor.policy_loss": "gspo",
        "actor.clip_ratio_low": 3e-4,
        "actor.clip_ratio_high": 4e-4,
        "actor.loss_agg_mode": "seq-mean-token-mean",
    },
    "cispo": {"actor.policy_loss": "cispo", "actor.clip_ratio_low": 1.0, "actor.loss_agg_mode": "token-mean"},
    "rloo": {"algorithm.adv_estimator": "rloo", "critic.enable": False},
    "reinforce_plus_plus": {"algorithm.adv_estimator": "reinforce_plus_plus", "critic.enable": False},
}


def _get(cfg: ExperimentConfig, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recipe_sets_what_its_paper_says(name):
    cfg = parse_config({**BASE, "recipe": name})
    for key, value in EXPECTED[name].items():
        assert _get(cfg, key) == value, (name, key)
    assert ExperimentConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_the_config_wins_over_its_recipe_and_unknown_recipes_are_named():
    cfg = parse_config({**BASE, "recipe": "dapo", "actor": {"clip_ratio_high": 0.3}})
    assert cfg.actor.clip_ratio_high == 0.3 and cfg.actor.clip_ratio_low == 0.2
    with pytest.raises(ConfigError, match="recipe: .*unknown recipe 'dapoo'; allowed: cispo, dapo"):
        parse_config({**BASE, "recipe": "dapoo"})


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"rollout": {"n": 1}, "algorithm": {"adv_estimator": "rloo"}}, "rollout.n >= 2"),
        (
            {"reward": {"reward_model": {"enable": True, "model": {"path": "rm"}}}},
            "disable reward.reward_model or dynamic sampling",
        ),
        (
            {"reward": {"overlong_buffer": {"length": 64}}, "rollout": {"n": 4, "response_length": 32}},
            "reward.overlong_buffer.length=64 exceeds rollout.response_length=32",
        ),
        ({"actor": {"policy_loss": "gspoo"}}, "unknown policy loss 'gspoo'; allowed: cispo, gspo"),
    ],
)
def test_dapo_settings_are_refused_with_the_fix(over, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        parse_config({**BASE, "recipe": "dapo", **over})


def test_default_overlong_buffer_is_a_fifth_of_the_response_length():
    cfg = parse_config({**BASE, "recipe": "dapo", "rollout": {"n": 2, "response_length": 20}})
    assert cfg.overlong_buffer_length() == 4
