"""The experiment config: one pydantic model tree, loadable from YAML.

Every section forbids unknown keys, so a typo is an error that names the field instead of a
silently ignored setting. Workers receive ``config.model_dump(mode="json")`` and rebuild it with
``ExperimentConfig.model_validate``.

    cfg = load_config("experiment.yaml")        # a path or any fsspec URL
    cfg = ExperimentConfig.model_validate({...})
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """A Hugging Face model directory or hub id (weights are read with ``from_pretrained``)."""

    path: str
    tokenizer_path: str | None = Field(None, description="defaults to `path`")
    trust_remote_code: bool = False
    dtype: Dtype = Field("float32", description="parameter dtype of the trained copy")
    enable_gradient_checkpointing: bool = False
    override_config: dict[str, Any] = Field(default_factory=dict)

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.path


class FSDPConfig(_Section):
    """FSDP2 layout. ``fsdp_size`` = -1 shards over all ranks (1-D mesh); a divisor of the
    world size smaller than it builds a 2-D (replicate x shard) mesh: hybrid sharding (HSDP)."""

    fsdp_size: int = -1
    param_dtype: Dtype | None = Field(
        None, description="mixed-precision compute dtype (e.g. bfloat16 on GPU); None = the model dtype"
    )
    reduce_dtype: Dtype = "float32"
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True


class OptimConfig(_Section):
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    warmup_steps: int = Field(
        0, description="linear LR warmup, in optimizer steps; overrides the ratio if > 0"
    )
    warmup_steps_ratio: float = Field(0.0, ge=0.0, le=1.0)
    total_training_steps: int | None = Field(None, description="needed only for warmup_steps_ratio")
    grad_clip: float = 1.0


class ActorConfig(_Section):
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer step (x rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    shuffle: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = Field(3.0, gt=1.0)
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    logprob_head: Literal["checkpoint", "fused"] = Field(
        "checkpoint",
        description="LM head for log-probs: chunks under activation checkpointing, or the fused "
        "chunked head with a hand-written backward (fewer passes over the logits)",
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, description="tokens per LM-head chunk (never the full logits)"
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RefConfig(_Section):
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    fsdp: FSDPConfig = Field(default_factory=lambda: FSDPConfig(param_offload=False))


class RolloutConfig(_Section):
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm, or hf (transformers generate) without vLLM"
    )
    n: int = Field(1, ge=1, description="responses sampled per prompt")
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 = off")
    prompt_length: int = Field(64, ge=1, description="prompts are left-padded/truncated to this many tokens")
    response_length: int = Field(32, ge=1)
    tensor_model_parallel_size: int = Field(1, ge=1)
    dtype: Dtype | None = Field(None, description="engine dtype; None = the model dtype")
    kv_cache_gib: float = Field(
        0.25, gt=0.0, description="KV-cache budget per engine, GiB (VLLM_CPU_KVCACHE_SPACE on CPU)"
    )
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    max_num_seqs: int = 256
    enforce_eager: bool = True
    seed: int = 0
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)


class CriticConfig(_Section):
    enable: bool = Field(
        True, description="needed by GAE; outcome estimators (grpo, rloo, ...) run without it"
    )
    model: ModelConfig | None = Field(None, description="defaults to the actor's base model")
    ppo_mini_batch_size: int = Field(16, ge=1)
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    forward_micro_batch_size_per_gpu: int = Field(8, ge=1)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RewardModelConfig(_Section):
    enable: bool = False
    model: ModelConfig | None = None
    micro_batch_size_per_gpu: int = Field(8, ge=1)
    max_length: int | None = None
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RewardConfig(_Section):
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    rule: bool = Field(True, description="score with the rule registered for each row's data_source")
    custom_function: str | None = Field(
        None,
        description="'package.module:function' (score(data_source, solution_str, ground_truth, extra_info) -> float)",
    )
    rm_weight: float = 1.0


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


class AlgorithmConfig(_Section):
    """PPO's estimator, KL terms and schedule. ``overlap`` (see README, "One-step off-policy"):
    ``none`` (default): iteration n samples with the weights after update n-1 (on-policy).
    ``one_step``: iteration n's data side (rollout, old log-probs, values) uses the actor and critic
    after update n-2, so generating iteration n+1 overlaps update n; the PPO ratio's denominator is
    the policy that sampled (n-2), clipped as usual. Deterministic for a given config."""

    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        "gae"
    )
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
    overlap: Literal["none", "one_step"] = Field(
        "none",
        description="one_step: the rollout of iteration n uses the weights after update n-2, so it "
        "overlaps update n-1 (one step off-policy); none: strictly on-policy",
    )


class DataConfig(_Section):
    train_files: list[str] = Field(description="parquet files in veRL's format")
    prompt_key: str = "prompt"
    train_batch_size: int = Field(16, ge=1, description="prompts per iteration")
    shuffle: bool = True
    seed: int = 0
    apply_chat_template: bool = True


class StorageConfig(_Section):
    root: str = Field("runs", description="fsspec URL or path: file://, s3://, memory://")
    experiment: str = "default"
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")

    @property
    def experiment_url(self) -> str:
        return self.root.rstrip("/") + "/" + self.experiment


class CheckpointConfig(_Section):
    """The actor's and critic's sharded checkpoints, one per committed iteration."""

    async_save: bool = Field(
        True,
        description="stage to host memory and write in the background (commit n waits for it, the "
        "next iteration does not); false: the update tasks write before they finish",
    )
    keep_last: int | None = Field(
        3, ge=1, description="keep the checkpoints of the last K committed iterations; null = keep all"
    )
    keep_every: int = Field(
        0, ge=0, description="also keep every M-th iteration's checkpoints (0 = none beyond keep_last)"
    )
    keep_every_weights_only: bool = Field(
        True,
        description="the every-M-th checkpoints keep only the model weights once they leave the last K "
        "(for export or as a reference policy; the optimizer state, 2/3 of a checkpoint, is deleted)",
    )
    verify: bool = Field(True, description="check every file's size and content hash before loading")
    write_attempts: int = Field(3, ge=1, description="DCP write attempts per checkpoint (storage hiccups)")
    write_threads: int = Field(
        1,
        ge=1,
        description="files each rank writes in parallel (DCP thread_count; try 4 on fast local disks)",
    )
    wait_timeout_s: float = Field(
        3600.0, gt=0, description="how long commit waits for a background write before failing"
    )


class ResourcesConfig(_Section):
    nprocs: int = Field(2, ge=1, description="ranks per worker group (one per GPU)")
    device: Literal["cpu", "cuda"] = "cpu"
    threads_per_rank: int | None = Field(None, description="CPU threads per rank; None = cores / ranks")


class ExperimentConfig(_Section):
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        n = self.resources.nprocs
        for name, fsdp in (("actor", self.actor.fsdp), ("critic", self.critic.fsdp), ("ref", self.ref.fsdp)):
            if fsdp.fsdp_size != -1 and (fsdp.fsdp_size < 1 or n % fsdp.fsdp_size):
                raise ValueError(
                    f"{name}.fsdp.fsdp_size={fsdp.fsdp_size} must be -1 or a divisor of resources.nprocs={n}"
                )
        tp = self.rollout.tensor_model_parallel_size
        if n % tp:
            raise ValueError(f"rollout.tensor_model_parallel_size={tp} must divide resources.nprocs={n}")
        if self.algorithm.adv_estimator == "gae" and not self.critic.enable:
            raise ValueError(
                "algorithm.adv_estimator='gae' needs a critic: set critic.enable=true or pick "
                "an outcome estimator (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline)"
            )
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator='{self.algorithm.adv_estimator}' compares responses to the "
                "same prompt: set rollout.n >= 2"
            )
        for name, size in (
            ("data.train_batch_size", self.data.train_batch_size),
            ("actor.ppo_mini_batch_size", self.actor.ppo_mini_batch_size),
        ):
            if (size * self.rollout.n) % n:
                raise ValueError(
                    f"{name}={size} x rollout.n={self.rollout.n} must be a multiple of "
                    f"resources.nprocs={n}: every rank trains on an equal share (padding "
                    "rows would be trained on twice)"
                )
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={self.data.train_batch_size} must be a multiple of "
                f"actor.ppo_mini_batch_size={self.actor.ppo_mini_batch_size}"
            )
        if self.critic.enable and self.data.train_batch_size % self.critic.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={self.data.train_batch_size} must be a multiple of "
                f"critic.ppo_mini_batch_size={self.critic.ppo_mini_batch_size}"
            )
        if not (self.reward.rule or self.reward.reward_model.enable or self.reward.custom_function):
            raise ValueError(
                "no reward source: enable reward.rule, reward.custom_function or reward.reward_model"
            )
        if self.reward.reward_model.enable and self.reward.reward_model.model is None:
            raise ValueError("reward.reward_model.enable=true needs reward.reward_model.model.path")
        return self

    @property
    def critic_model(self) -> ModelConfig:
        return self.critic.model or self.model

    def identity(self) -> dict[str, Any]:
        """What an experiment may not change between iterations (other weights or tokenizer)."""
        ids = {
            "model.path": self.model.path,
            "model.tokenizer": self.model.tokenizer,
            "critic.model": self.critic_model.path if self.critic.enable else None,
        }
        return ids

    def config_hash(self) -> str:
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def format_validation_error(err: ValidationError, source: str = "config") -> str:
    """One readable message: every bad field with its dotted path, what was given and what is allowed."""
    lines = [f"invalid {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        given = e.get("input")
        given_s = "" if isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"  {loc}: {e['msg']}{given_s}")
    return "\n".join(lines)


class ConfigError(ValueError):
    """A config that cannot run; the message names each bad field and the allowed values."""


def parse_config(data: dict[str, Any], source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(path_or_url: str, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML config from a path or fsspec URL; ``overrides`` are dotted keys (``{"rollout.n": 4}``)."""
    from ppoflow.infra.data import storage

    text = storage.read_bytes(path_or_url).decode()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path_or_url}: the top level of a config must be a mapping, got {type(data).__name__}"
        )
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_config(data, source=path_or_url)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
