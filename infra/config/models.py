"""The trained models' sections: the policy (``model``, ``actor``, ``ref``), the critic and the
reward (rule and model), with their FSDP and optimizer settings."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ppoflow.infra.config.names import Dtype, KLPenaltyKind, LossAggMode, PolicyLossName, Section
from ppoflow.infra.config.remote_reward import RemoteRewardConfig

__all__ = [
    "ModelConfig",
    "FSDPConfig",
    "LoRAConfig",
    "OptimConfig",
    "ActorConfig",
    "RefConfig",
    "CriticConfig",
    "RewardModelConfig",
    "RewardConfig",
]


class ModelConfig(Section):
    """A Hugging Face model directory or hub id (weights are read with ``from_pretrained``)."""

    path: str
    tokenizer_path: str | None = Field(None, description="defaults to `path`")
    trust_remote_code: bool = False
    dtype: Dtype = Field("float32", description="parameter dtype of the trained copy")
    enable_gradient_checkpointing: bool = False
    use_torch_compile: bool | None = Field(
        None,
        description="torch.compile each decoder layer and the policy's LM-head math (fuses the "
        "elementwise work around the matmuls; compiles once per run). null: on with "
        "resources.device cuda (without LoRA), off on CPU",
    )
    override_config: dict[str, Any] = Field(default_factory=dict)

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.path


class FSDPConfig(Section):
    """FSDP2 layout. ``fsdp_size`` = -1 shards over all ranks (1-D mesh); a divisor of the
    world size smaller than it builds a 2-D (replicate x shard) mesh: hybrid sharding (HSDP)."""

    fsdp_size: int = -1
    param_dtype: Dtype | None = Field(
        None,
        description="mixed-precision compute dtype; null: bfloat16 with resources.device cuda (over "
        "the model dtype's master weights), the model dtype on CPU",
    )
    reduce_dtype: Dtype = "float32"
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True


#: A token budget's ``auto`` for an update micro-batch (per GPU), when the longest row is shorter.
AUTO_UPDATE_TOKENS = 16384
#: A per-GPU token budget: a number of tokens, or ``auto`` (resolved when the config is loaded).
TokenBudget = Annotated[int, Field(ge=1)] | Literal["auto"]


def resolved_budget(value: int | Literal["auto"], field: str) -> int:
    """A token budget as a number; ``auto`` is resolved only when the whole config is validated
    (``ExperimentConfig``), so a section built alone that still holds it is an error naming it."""
    if value == "auto":
        raise ValueError(f"{field} is 'auto', which only a whole experiment config resolves")
    return value


LINEAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class LoRAConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on a frozen base model: only the adapters (and a critic's
    value head) are trained, checkpointed and, for the policy, synced into the rollout engine.
    ``rank`` 0 (the default) trains every parameter."""

    rank: int = Field(0, ge=0, description="the adapters' rank r; 0 = LoRA off (full fine-tuning)")
    alpha: float = Field(16.0, gt=0.0, description="scaling: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input while training")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="'all-linear' (every linear layer of the decoder, not the LM head) or a list of "
        "module names (suffixes such as q_proj, v_proj)",
    )
    sync: Literal["adapter", "merged"] = Field(
        "merged",
        description="policy only: how the rollout engine gets new weights: 'merged' merges the "
        "adapters into the base weights and pushes every weight (faster on GPU and CPU: "
        "docs/lora.md), 'adapter' pushes the adapter tensors (vLLM's LoRA serving, the base stays "
        "in the engine)",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            if value != "all-linear":
                raise ValueError(
                    f"lora.target_modules={value!r}: give 'all-linear' or a list of module names "
                    "(e.g. [q_proj, v_proj])"
                )
            return value
        if not value:
            raise ValueError(
                "lora.target_modules is an empty list: name at least one module, or 'all-linear'"
            )
        bad = [v for v in value if not LINEAR_NAME.match(v)]
        if bad:
            raise ValueError(f"lora.target_modules: {bad} are not module names (e.g. q_proj, mlp.down_proj)")
        if "lm_head" in value:
            raise ValueError(
                "lora.target_modules: lm_head cannot carry an adapter (vLLM serves none there and "
                "the policy's log-prob head reads its weight directly); leave it out"
            )
        return value


class OptimConfig(Section):
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


class ActorConfig(Section):
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer step (x rollout.n samples)")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    shuffle: bool = False
    policy_loss: PolicyLossName = Field(
        "vanilla",
        description="the policy loss (ppoflow.algos.POLICY_LOSSES): vanilla (PPO's clip), gspo "
        "(sequence-level ratio), gspo_token, cispo (clipped stop-gradient IS weights); "
        "docs/algorithms.md lists each one's paper defaults",
    )
    clip_ratio_low: float = Field(
        0.2,
        ge=0.0,
        description="the ratio's lower bound is 1 - this (1: none; above 1 only for cispo, where it "
        "also means none)",
    )
    clip_ratio_high: float = Field(0.2, ge=0.0, description="the ratio's upper bound is 1 + this")
    clip_ratio_c: float = Field(3.0, gt=1.0)
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLPenaltyKind = "low_var_kl"
    teacher_kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="on-policy distillation as a loss term: + this x KL(policy || teacher) per token, "
        "aggregated as the policy loss (needs a teacher; 0 = off; docs/distillation.md)",
    )
    teacher_kl_type: KLPenaltyKind = Field(
        "k2",
        description="the teacher term's estimator: k2 (= mse), whose gradient on the policy's own "
        "samples is the reverse KL's; k3 (low_var_kl) gives the forward KL's, k1 (kl) none",
    )
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    logprob_head: Literal["checkpoint", "fused"] | None = Field(
        None,
        description="LM head for log-probs: chunks under activation checkpointing, or the fused "
        "chunked head with a hand-written backward (fewer passes over the logits); null: fused "
        "with resources.device cuda, checkpoint on CPU",
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, description="tokens per LM-head chunk (never the full logits)"
    )
    use_dynamic_bsz: bool = Field(
        True,
        description="pack each micro-batch's real tokens into one row (no compute on padding) and form "
        "micro-batches by a token budget instead of a row count (false: ppo_micro_batch_size_per_gpu "
        "padded rows)",
    )
    ppo_max_token_len_per_gpu: TokenBudget = Field(
        "auto",
        description="with use_dynamic_bsz: real tokens per update micro-batch per GPU; auto: "
        f"{AUTO_UPDATE_TOKENS} or the longest row, whichever is larger; on GPUs the memory plan's "
        "largest that fits (docs/gpus.md)",
    )
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="with use_dynamic_bsz: tokens per log-prob micro-batch; null: twice "
        "ppo_max_token_len_per_gpu (a forward keeps no activations for a backward)",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: groups of this many ranks split each packed "
        "micro-batch's tokens (needs use_dynamic_bsz; must divide resources.nprocs; the token "
        "budgets stay per GPU, a micro-batch holds this many times them). 1 = off",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @property
    def update_tokens(self) -> int:
        """Real tokens per packed update micro-batch per GPU (``ppo_max_token_len_per_gpu``)."""
        return resolved_budget(self.ppo_max_token_len_per_gpu, "actor.ppo_max_token_len_per_gpu")

    @property
    def log_prob_tokens(self) -> int:
        """Tokens per packed log-prob micro-batch: the budget given, else twice the update's."""
        return self.log_prob_max_token_len_per_gpu or 2 * self.update_tokens

    @model_validator(mode="after")
    def _check_clip_ratio_low(self) -> ActorConfig:
        """``clip_ratio_low`` > 1 puts the lower bound ``1 - clip_ratio_low`` below 0, where no ratio
        lies: the same as 1.0 (no lower clip). CISPO recipes elsewhere write 10, so ``cispo`` takes
        it; for the other losses it is more likely a slip, and the error says what it would mean."""
        low = self.clip_ratio_low
        if low > 1.0 and self.policy_loss != "cispo":
            raise ValueError(
                f"actor.clip_ratio_low={low:g} puts the ratio's lower bound at 1 - {low:g} < 0, where "
                "no ratio lies: it means no lower clip, as 1.0 does. Only policy_loss 'cispo' accepts "
                f"values above 1 (its recipes write 10); for {self.policy_loss!r} write 1.0 for no "
                "lower clip, or the distance below 1 (e.g. 0.2 for a bound at 0.8)"
            )
        return self


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    log_prob_use_dynamic_bsz: bool | None = Field(None, description="None = actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int | None = Field(
        None, ge=1, description="None = the actor's log-prob token budget"
    )
    sequence_parallel_size: int | None = Field(
        None,
        ge=1,
        description="None = actor.sequence_parallel_size (a reference on the actor's ranks must use it)",
    )
    fsdp: FSDPConfig = Field(default_factory=lambda: FSDPConfig(param_offload=False))


class CriticConfig(Section):
    enable: bool | None = Field(
        None,
        description="null (the default): on exactly when algorithm.adv_estimator reads values (gae); "
        "true with an estimator that reads none (grpo, rloo, ...) is refused: the critic would "
        "train every iteration and nothing would read it",
    )
    model: ModelConfig | None = Field(None, description="defaults to the actor's base model")
    ppo_mini_batch_size: int = Field(16, ge=1)
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"
    forward_micro_batch_size_per_gpu: int = Field(8, ge=1)
    use_dynamic_bsz: bool | None = Field(
        None,
        description="pack each micro-batch's real tokens into one row and form micro-batches by a "
        "token budget (null: as actor.use_dynamic_bsz)",
    )
    ppo_max_token_len_per_gpu: TokenBudget = Field(
        "auto",
        description="with use_dynamic_bsz: real tokens per update micro-batch per GPU; auto: "
        f"{AUTO_UPDATE_TOKENS} or the longest row, whichever is larger; on GPUs the memory plan's "
        "largest that fits (docs/gpus.md)",
    )
    forward_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="with use_dynamic_bsz: tokens per values micro-batch; null: twice ppo_max_token_len_per_gpu",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ulysses sequence parallelism: groups of this many ranks split each packed "
        "micro-batch's tokens (needs use_dynamic_bsz; must divide resources.nprocs; the token "
        "budgets stay per GPU, a micro-batch holds this many times them). 1 = off",
    )
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="adapters on the critic's base; its value head stays fully trained",
    )

    @property
    def packed(self) -> bool:
        """``use_dynamic_bsz`` as resolved (null follows the actor's once the config is whole)."""
        return bool(self.use_dynamic_bsz)

    @property
    def update_tokens(self) -> int:
        """Real tokens per packed update micro-batch per GPU (``ppo_max_token_len_per_gpu``)."""
        return resolved_budget(self.ppo_max_token_len_per_gpu, "critic.ppo_max_token_len_per_gpu")

    @property
    def forward_tokens(self) -> int:
        """Tokens per packed values micro-batch: the budget given, else twice the update's."""
        return self.forward_max_token_len_per_gpu or 2 * self.update_tokens


class RewardModelConfig(Section):
    enable: bool = False
    model: ModelConfig | None = None
    micro_batch_size_per_gpu: int = Field(8, ge=1)
    use_dynamic_bsz: bool | None = Field(
        None,
        description="score packed micro-batches of forward_max_token_len_per_gpu real tokens "
        "(null: as actor.use_dynamic_bsz)",
    )
    forward_max_token_len_per_gpu: int = Field(32768, ge=1)
    max_length: int | None = None
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)


class OverlongBufferConfig(Section):
    """DAPO's overlong reward shaping: a response whose length enters the last ``length`` tokens
    before ``rollout.response_length`` gets a penalty growing linearly to ``-penalty_factor``."""

    enable: bool = False
    length: int | None = Field(
        None,
        ge=1,
        description="the buffer in tokens; None = a fifth of rollout.response_length (DAPO: 4096 of 20480)",
    )
    penalty_factor: float = Field(1.0, ge=0.0)


class RewardConfig(Section):
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    rule: bool = Field(True, description="score with the rule registered for each row's data_source")
    custom_function: str | None = Field(
        None,
        description="'package.module:function' (score(data_source, solution_str, ground_truth, extra_info) -> float)",
    )
    remote: RemoteRewardConfig | None = Field(
        None, description="a reward service over HTTP that scores every row (instead of custom_function)"
    )
    rm_weight: float = 1.0
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)

    @model_validator(mode="after")
    def _one_reward_for_every_row(self) -> RewardConfig:
        if self.remote is not None and self.custom_function:
            raise ValueError(
                "reward.remote and reward.custom_function both score every row; keep one of them"
            )
        return self
