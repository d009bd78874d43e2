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
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

Dtype = Literal["float32", "bfloat16", "float16"]


def _registry(name: str) -> Callable[[], Iterable[str]]:
    """The names in ``ppoflow.algos.<name>`` (imported when a config is validated)."""

    def names() -> Iterable[str]:
        import ppoflow.algos

        return getattr(ppoflow.algos, name)

    return names


def _one_of(what: str, names: Callable[[], Iterable[str]]) -> Any:
    """A ``str`` field whose allowed values are a registry's names. The registry is the only list:
    an estimator registered with ``@register_adv_estimator`` is valid at once, and the JSON schema
    (the Prefect UI's form) offers the names registered when it is generated."""

    def check(value: str) -> str:
        allowed = sorted(names())
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
        return value

    return Annotated[
        str,
        AfterValidator(check),
        Field(json_schema_extra=lambda schema: schema.update(enum=sorted(names()))),
    ]


AdvEstimatorName = _one_of("advantage estimator", _registry("ADV_ESTIMATORS"))
LossAggMode = _one_of("loss aggregation mode", _registry("LOSS_AGG_MODES"))
KLPenaltyKind = _one_of("KL penalty kind", _registry("KL_PENALTY_KINDS"))
KLControllerKind = _one_of("KL controller", _registry("KL_CONTROLLERS"))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """A Hugging Face model directory or hub id (weights are read with ``from_pretrained``)."""

    path: str
    tokenizer_path: str | None = Field(None, description="defaults to `path`")
    trust_remote_code: bool = False
    dtype: Dtype = Field("float32", description="parameter dtype of the trained copy")
    enable_gradient_checkpointing: bool = False
    use_torch_compile: bool = Field(
        False,
        description="torch.compile each decoder layer and the policy's LM-head math (fuses the "
        "elementwise work around the matmuls; meant for GPUs, compiles once per run)",
    )
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
    fused: bool | None = Field(
        None,
        description="AdamW's fused kernel (True), its foreach/for-loop kernels (False), or None = fused "
        "on CUDA, torch's default elsewhere",
    )


class ActorConfig(_Section):
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer step (x rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    shuffle: bool = False
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = Field(3.0, gt=1.0)
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLPenaltyKind = "low_var_kl"
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    logprob_head: Literal["checkpoint", "fused"] = Field(
        "checkpoint",
        description="LM head for log-probs: chunks under activation checkpointing, or the fused "
        "chunked head with a hand-written backward (fewer passes over the logits)",
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, description="tokens per LM-head chunk (never the full logits)"
    )
    use_dynamic_bsz: bool = Field(
        False,
        description="pack each micro-batch's real tokens into one row (no compute on padding) and form micro-batches "
        "by a token budget instead of a row count",
    )
    ppo_max_token_len_per_gpu: int = Field(
        16384, ge=1, description="with use_dynamic_bsz: real tokens per update micro-batch per GPU"
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="with use_dynamic_bsz: tokens per log-prob micro-batch; None = ppo_max_token_len_per_gpu",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RefConfig(_Section):
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    log_prob_use_dynamic_bsz: bool | None = Field(None, description="None = actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = Field(
        None, ge=1, description="None = the actor's log-prob token budget"
    )
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
    tensor_model_parallel_size: int = Field(
        1, ge=1, description="vLLM tensor parallelism; training always uses every rank whatever it is"
    )
    dtype: Dtype | None = Field(None, description="engine dtype; None = the model dtype")
    kv_cache_gib: Annotated[float, Field(gt=0.0)] | Literal["auto"] | None = Field(
        "auto",
        description="KV-cache budget per engine, GiB. GPU: 'auto' = what the batch needs (each "
        "engine's sequences at once, at prompt_length + response_length tokens, +25%, >= 1 GiB); "
        "None = vLLM sizes it from gpu_memory_utilization, profiling the device's memory at "
        "start-up (which assumes no other process changes its memory meanwhile: not so with "
        "colocated worker groups). CPU: 'auto' and None = 0.25 (VLLM_CPU_KVCACHE_SPACE, whole "
        "GiB, overrides it)",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="GPU: vLLM starts only if this share of the device is free; with kv_cache_gib None "
        "it is also the engine's whole budget (weights, activations, CUDA graphs, KV cache)",
    )
    max_num_seqs: int = Field(256, ge=1, description="most sequences one engine decodes at once")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="tokens per engine step (chunked prefill budget); None = vLLM's default"
    )
    enforce_eager: bool | None = Field(
        None, description="None: eager on CPU, CUDA graphs on GPU (2-2.5x faster decoding); or force it"
    )
    sleep_level: Literal[1, 2] | None = Field(
        None,
        description="GPU: how the engine sleeps after each rollout to give its memory to training. "
        "2 discards weights and KV cache (nothing copied; the next rollout pushes the weights); 1 also "
        "frees the GPU but keeps the weights in host memory. None: 2 when the engine shares its ranks "
        "with the trained actor (which pushes new weights before every rollout anyway), else 1",
    )
    weight_loader: Literal["hf", "dtensor"] = Field(
        "hf",
        description="FSDP -> engine push with TP > 1: hf (every rank gets full tensors, vLLM slices) or "
        "dtensor (each TP rank receives only its slices of the linear layers)",
    )
    calculate_log_probs: bool = Field(
        False,
        description="vLLM: also return the engine's log-prob of each sampled token (the "
        "rollout_log_probs column, a check of engine/trainer agreement: benchmarks/gpu_check.py). PPO "
        "never needs it (the actor recomputes old_log_probs), and it costs vLLM about a fifth of its "
        "sampling rate (H200, 0.5B: 36.5k against 45.5k tokens/s). The HF engine always returns it",
    )
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
    loss_agg_mode: LossAggMode = "token-mean"
    forward_micro_batch_size_per_gpu: int = Field(8, ge=1)
    use_dynamic_bsz: bool = Field(
        False,
        description="pack each micro-batch's real tokens into one row (no compute on padding) and form micro-batches "
        "by a token budget instead of a row count",
    )
    ppo_max_token_len_per_gpu: int = Field(
        32768, ge=1, description="with use_dynamic_bsz: real tokens per update micro-batch per GPU"
    )
    forward_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="with use_dynamic_bsz: tokens per values micro-batch; None = ppo_max_token_len_per_gpu",
    )
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class RewardModelConfig(_Section):
    enable: bool = False
    model: ModelConfig | None = None
    micro_batch_size_per_gpu: int = Field(8, ge=1)
    use_dynamic_bsz: bool = Field(
        False, description="score packed micro-batches of forward_max_token_len_per_gpu real tokens"
    )
    forward_max_token_len_per_gpu: int = Field(32768, ge=1)
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
    type: KLControllerKind = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


class AlgorithmConfig(_Section):
    """PPO's estimator, KL terms and schedule. ``overlap`` (docs/checkpoints.md, "One-step off-policy"):
    ``none`` (default): iteration n samples with the weights after update n-1 (on-policy).
    ``one_step``: iteration n's data side (rollout, old log-probs, values) uses the actor and critic
    after update n-2, so generating iteration n+1 overlaps update n; the PPO ratio's denominator is
    the policy that sampled (n-2), clipped as usual. Deterministic for a given config."""

    adv_estimator: AdvEstimatorName = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLPenaltyKind = "kl"
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
    truncation: Literal["error", "left", "right"] = Field(
        "left",
        description="a prompt longer than rollout.prompt_length: drop its first tokens (left), its "
        "last tokens (right), or fail naming the row (error)",
    )
    filter_overlong_prompts: bool = Field(
        False,
        description="drop prompts longer than rollout.prompt_length when the dataset is loaded "
        "(tokenizes every prompt once per run)",
    )


class StorageConfig(_Section):
    root: str = Field("runs", description="fsspec URL or path: file://, s3://, memory://")
    experiment: str = "default"
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    shared_filesystem: bool = Field(
        False,
        description="a local `root` is a filesystem mounted at the same path on every node (NFS, "
        "Lustre): lets a multi-node run (resources.launch: rendezvous) use it instead of S3",
    )

    @property
    def experiment_url(self) -> str:
        return self.root.rstrip("/") + "/" + self.experiment


class RendezvousConfig(_Section):
    """Worker groups whose ranks span nodes (``resources.launch: rendezvous``). Each node runs
    ``ppoflow agent --driver <driver_host>:<control_port>``; the flow's process hosts the control
    endpoint and the c10d rendezvous store. The cluster key comes from the environment
    (PPOFLOW_CLUSTER_KEY_FILE / PPOFLOW_CLUSTER_KEY), never from this config."""

    nnodes: int = Field(2, ge=1, description="nodes every worker group spans (one `ppoflow agent` each)")
    nproc_per_node: int = Field(1, ge=1, description="ranks per node (one per GPU)")
    driver_host: str | None = Field(
        None, description="address the agents and ranks reach the flow's process at; None = its FQDN"
    )
    bind_host: str = Field(
        "0.0.0.0",
        description="interface the control endpoint listens on (every connection must pass the "
        "cluster-key handshake)",
    )
    control_port: int = Field(
        29401, ge=0, le=65535, description="the agents' --driver port; ranks dial it too"
    )
    rdzv_port: int = Field(
        29400,
        ge=0,
        le=65535,
        description="the c10d rendezvous store (torchrun --rdzv-endpoint), on the driver",
    )
    join_timeout_s: float = Field(
        300.0,
        gt=0,
        description="how long a group start waits for every node's agent, then for the rendezvous",
    )


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
    launch: Literal["local", "rendezvous"] = Field(
        "local",
        description="local: every group's ranks on the flow's host (torchrun --standalone); "
        "rendezvous: on `rendezvous.nnodes` nodes, each running `ppoflow agent`",
    )
    nprocs: int = Field(
        2, ge=1, description="ranks per worker group (one per GPU); rendezvous: nnodes x nproc_per_node"
    )
    device: Literal["cpu", "cuda"] = "cpu"
    threads_per_rank: int | None = Field(None, description="CPU threads per rank; None = cores / ranks")
    rendezvous: RendezvousConfig = Field(default_factory=RendezvousConfig)

    @model_validator(mode="before")
    @classmethod
    def _world_from_nodes(cls, data: Any) -> Any:
        """With ``launch: rendezvous`` and no ``nprocs``, the world is nnodes x nproc_per_node."""
        if isinstance(data, dict) and data.get("launch") == "rendezvous" and "nprocs" not in data:
            nodes = data.get("rendezvous")
            nodes = nodes.model_dump() if isinstance(nodes, RendezvousConfig) else dict(nodes or {})
            try:
                data = {**data, "nprocs": int(nodes.get("nnodes", 2)) * int(nodes.get("nproc_per_node", 1))}
            except (TypeError, ValueError):
                pass  # the field validators report the bad number
        return data

    @model_validator(mode="after")
    def _check_world(self) -> ResourcesConfig:
        nodes = self.rendezvous
        if self.launch == "rendezvous" and self.nprocs != nodes.nnodes * nodes.nproc_per_node:
            raise ValueError(
                f"resources.nprocs={self.nprocs} must equal rendezvous.nnodes={nodes.nnodes} x "
                f"rendezvous.nproc_per_node={nodes.nproc_per_node} (or leave nprocs out)"
            )
        return self


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
        from ppoflow.algos import ADV_ESTIMATORS, estimator_inputs

        est = self.algorithm.adv_estimator
        needs = estimator_inputs(est)
        if "values" in needs and not self.critic.enable:
            others = sorted(n for n in ADV_ESTIMATORS if "values" not in estimator_inputs(n))
            raise ValueError(
                f"algorithm.adv_estimator='{est}' needs a critic: set critic.enable=true or pick "
                f"an estimator that runs without one ({', '.join(others)})"
            )
        if "index" in needs and self.rollout.n < 2:
            raise ValueError(
                f"algorithm.adv_estimator='{est}' compares responses to the same prompt: set rollout.n >= 2"
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

    @model_validator(mode="after")
    def _check_token_budgets(self) -> ExperimentConfig:
        """With use_dynamic_bsz every token budget must hold the longest rollout row."""
        longest = self.rollout.prompt_length + self.rollout.response_length
        budgets = []
        if self.actor.use_dynamic_bsz:
            budgets.append(("actor.ppo_max_token_len_per_gpu", self.actor.ppo_max_token_len_per_gpu))
        if self.actor.use_dynamic_bsz or self.ref.log_prob_use_dynamic_bsz:
            budgets.append(
                ("actor.log_prob_max_token_len_per_gpu", self.actor.log_prob_max_token_len_per_gpu)
            )
            budgets.append(("ref.log_prob_max_token_len_per_gpu", self.ref.log_prob_max_token_len_per_gpu))
        if self.critic.enable and self.critic.use_dynamic_bsz:
            budgets.append(("critic.ppo_max_token_len_per_gpu", self.critic.ppo_max_token_len_per_gpu))
            budgets.append(
                ("critic.forward_max_token_len_per_gpu", self.critic.forward_max_token_len_per_gpu)
            )
        for name, budget in budgets:
            if budget is not None and budget < longest:
                raise ValueError(
                    f"{name}={budget} is smaller than the longest row: rollout.prompt_length + "
                    f"rollout.response_length = {longest} tokens; raise it to at least {longest}"
                )
        return self

    @model_validator(mode="after")
    def _check_multinode_storage(self) -> ExperimentConfig:
        """Ranks on other hosts read and write the experiment's storage: it must reach them."""
        if self.resources.launch != "rendezvous":
            return self
        root = self.storage.root
        from ppoflow.infra.data.storage import protocol_of

        proto = protocol_of(root)
        if proto == "memory":
            raise ValueError(
                f"storage.root={root!r} lives in one process; a multi-node run "
                "(resources.launch: rendezvous) needs storage every node reaches: use s3://..."
            )
        if proto in ("file", "local") and not self.storage.shared_filesystem:
            raise ValueError(
                f"storage.root={root!r} is a local path that the other nodes of a multi-node run "
                "(resources.launch: rendezvous) cannot read: use object storage (s3://bucket/prefix), "
                "or, if it is a shared filesystem mounted at the same path on every node (NFS, Lustre), "
                "set storage.shared_filesystem: true"
            )
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


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Set dotted keys (``{"rollout.n": 4, "actor.optim.lr": 3e-6}``) in a config mapping, in
    place, creating the sections on the way; returns ``data``."""
    for key, value in (overrides or {}).items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return data


def load_config(path_or_url: str, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML config from a path or fsspec URL; ``overrides`` are dotted keys (``{"rollout.n": 4}``)."""
    from ppoflow.infra.data import storage

    text = storage.read_bytes(path_or_url).decode()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path_or_url}: the top level of a config must be a mapping, got {type(data).__name__}"
        )
    return parse_config(apply_overrides(data, overrides), source=path_or_url)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
