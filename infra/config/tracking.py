"""Experiment trackers the config turns on: ``tracking.wandb`` (Weights & Biases).

MLflow is turned on by the environment instead (``MLFLOW_TRACKING_URI``), and both may be on at
once (docs/deployments.md). The W&B API key is never part of a config: a config is stored with the
experiment, in Prefect's database and in every deployment's parameters, so the key comes from
``WANDB_API_KEY`` in the environment of the process that runs the flows.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ppoflow.infra.config.names import Section

__all__ = ["TrackingConfig", "WandbConfig", "WANDB_API_KEY_ENV"]

#: Where an online W&B run's key comes from (W&B's own variable; never from the config)
WANDB_API_KEY_ENV = "WANDB_API_KEY"
_SECRET_KEYS = ("api_key", "key", "wandb_api_key")


class WandbConfig(Section):
    """One W&B run per experiment, resumed by every later flow run of it (docs/deployments.md)."""

    project: str = Field("ppoflow", min_length=1, description="the W&B project the experiment's run is in")
    entity: str | None = Field(None, description="the W&B team or user (null: the API key's default entity)")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: to the W&B server (needs WANDB_API_KEY in the environment); offline: run "
        "files on local disk that `wandb sync` uploads later; disabled: no W&B at all",
    )
    dir: str | None = Field(
        None,
        description="a local directory W&B writes the run's files under (<dir>/wandb/); null: "
        "WANDB_DIR when set, else the experiment's directory when storage.root is local, else ./wandb",
    )
    name: str | None = Field(None, description="the run's display name (null: the experiment's name)")
    group: str | None = Field(None, description="the W&B group of the run (e.g. a sweep's name)")
    tags: list[str] = Field(default_factory=list, description="the run's W&B tags")
    notes: str | None = Field(None, description="the run's W&B notes")

    @model_validator(mode="before")
    @classmethod
    def _no_secret(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in _SECRET_KEYS:
                if key in data:
                    raise ValueError(
                        f"{key}: the W&B API key is never read from a config (configs are stored "
                        f"with the experiment and in Prefect); set {WANDB_API_KEY_ENV} in the "
                        "environment of the process that runs the flows (the worker's, or your shell's "
                        "for `ppoflow run`)"
                    )
        return data

    @field_validator("dir")
    @classmethod
    def _local_dir(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            raise ValueError(
                "W&B writes its run files with plain file I/O, not through fsspec: give a local "
                "directory (a mounted volume for a worker whose disk does not last)"
            )
        return value


class TrackingConfig(Section):
    """Trackers beside the experiment's own records (metrics.json, the Prefect UI)."""

    wandb: WandbConfig | None = Field(
        None,
        description="Weights & Biases: metrics, config, sample tables and evaluations of the "
        "experiment in one W&B run (null: off)",
    )
