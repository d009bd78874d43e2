"""``tracking.wandb``: off unless set, its defaults, and what a config may not hold (the API key,
a remote directory, a mode W&B does not have), each refused naming the field and the fix."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ConfigError, parse_config

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["x.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
}


def test_off_unless_set_and_its_defaults():
    assert parse_config(BASE).tracking.wandb is None
    wandb = parse_config({**BASE, "tracking": {"wandb": {"mode": "offline"}}}).tracking.wandb
    assert wandb is not None
    assert (wandb.project, wandb.entity, wandb.mode, wandb.dir, wandb.name) == (
        "ppoflow",
        None,
        "offline",
        None,
        None,
    )
    assert parse_config({**BASE, "tracking": {"wandb": {}}}).tracking.wandb.mode == "online"


@pytest.mark.parametrize("key", ["api_key", "key", "wandb_api_key"])
def test_an_api_key_in_the_config_is_refused_naming_the_environment_variable(key):
    secret = "0123456789abcdef0123456789abcdef01234567"
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "tracking": {"wandb": {"project": "p", key: secret}}})
    message = str(err.value)
    assert "tracking.wandb" in message and f"{key}: the W&B API key is never read from a config" in message
    assert "WANDB_API_KEY" in message
    assert secret not in message  # not echoed into logs either


def test_a_remote_dir_and_an_unknown_mode_are_refused():
    with pytest.raises(ConfigError, match=r"tracking\.wandb\.dir: .*give a local directory"):
        parse_config({**BASE, "tracking": {"wandb": {"dir": "s3://bucket/wandb"}}})
    with pytest.raises(ConfigError, match=r"tracking\.wandb\.mode: Input should be 'online', 'offline' or"):
        parse_config({**BASE, "tracking": {"wandb": {"mode": "on"}}})
    with pytest.raises(ConfigError, match=r"tracking\.wandb\.projekt"):
        parse_config({**BASE, "tracking": {"wandb": {"projekt": "p"}}})
