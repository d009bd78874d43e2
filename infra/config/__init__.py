"""The experiment config: one pydantic model tree, loadable from YAML.

Every section forbids unknown keys, so a typo is an error that names the field instead of a
silently ignored setting. Workers receive ``config.model_dump(mode="json")`` and rebuild it with
``ExperimentConfig.model_validate``.

    cfg = load_config("experiment.yaml")        # a path or any fsspec URL
    cfg = ExperimentConfig.model_validate({...})

The sections live by subject: ``models`` (policy, reference, critic, reward), ``iteration``
(rollout, algorithm, data), ``multiturn`` (the rollout's episodes), ``evaluation`` (held-out
evaluation), ``asynchronous`` (the rollout queue of asynchronous training), ``system`` (storage,
checkpoints, resources), ``tracking`` (Weights & Biases), ``experiment`` (the whole tree and the
checks that span sections); ``names`` holds their shared pieces (the section base, dtypes, names
checked against the registries), ``recipes`` the named recipes (PPO, GRPO, ...), ``loading``
YAML in and out and its errors.
"""

from ppoflow.infra.config.asynchronous import AsyncConfig, ProducerPlacement
from ppoflow.infra.config.correction import RolloutCorrectionConfig
from ppoflow.infra.config.evaluation import EvaluationConfig
from ppoflow.infra.config.experiment import ExperimentConfig
from ppoflow.infra.config.iteration import AlgorithmConfig, DataConfig, KLControlConfig, RolloutConfig
from ppoflow.infra.config.loading import (
    ConfigError,
    apply_overrides,
    dump_config,
    format_validation_error,
    load_config,
    parse_config,
)
from ppoflow.infra.config.models import (
    ActorConfig,
    CriticConfig,
    FSDPConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
)
from ppoflow.infra.config.multiturn import MultiTurnConfig
from ppoflow.infra.config.names import Dtype
from ppoflow.infra.config.system import CheckpointConfig, RendezvousConfig, ResourcesConfig, StorageConfig
from ppoflow.infra.config.tracking import TrackingConfig, WandbConfig

__all__ = [
    "ExperimentConfig",
    "AsyncConfig",
    "ProducerPlacement",
    "EvaluationConfig",
    "ModelConfig",
    "FSDPConfig",
    "LoRAConfig",
    "OptimConfig",
    "ActorConfig",
    "RefConfig",
    "CriticConfig",
    "RewardModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "MultiTurnConfig",
    "KLControlConfig",
    "AlgorithmConfig",
    "RolloutCorrectionConfig",
    "DataConfig",
    "StorageConfig",
    "RendezvousConfig",
    "CheckpointConfig",
    "ResourcesConfig",
    "TrackingConfig",
    "WandbConfig",
    "Dtype",
    "ConfigError",
    "format_validation_error",
    "parse_config",
    "apply_overrides",
    "load_config",
    "dump_config",
]
