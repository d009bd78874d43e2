"""What every worker class does first: rebuild the ``ExperimentConfig`` from the group's config
dict and pick its role (its ``init_model`` then seeds the rank's RNGs with
:func:`ppoflow.infra.remote.rank.seeding.seed_rngs`).

    cfg, role = parse_worker_config(config, ROLES, "actor_rollout_ref")   # in Worker.__init__
"""

from __future__ import annotations

from typing import Any

from ppoflow.infra.config import ExperimentConfig

__all__ = ["experiment_config", "parse_worker_config"]


def experiment_config(config: dict[str, Any]) -> ExperimentConfig:
    """The ``ExperimentConfig`` of a worker config ``{"config": dict | json str, ...}``, validated."""
    if "config" not in config:
        raise KeyError("the worker config needs a 'config' entry (ExperimentConfig.model_dump(mode='json'))")
    raw = config["config"]
    return (
        ExperimentConfig.model_validate_json(raw)
        if isinstance(raw, str)
        else ExperimentConfig.model_validate(raw)
    )


def parse_worker_config(
    config: dict[str, Any], roles: tuple[str, ...], default_role: str
) -> tuple[ExperimentConfig, str]:
    """``{"config": dict | json str, "role": str}`` -> (ExperimentConfig, role), validated."""
    cfg = experiment_config(config)
    role = config.get("role", default_role)
    if role not in roles:
        raise ValueError(f"unknown role {role!r}; allowed: {', '.join(roles)}")
    return cfg, role
