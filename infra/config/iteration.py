"""What one iteration does: the rollout, the algorithm (estimator, KL terms, overlap) and the data.

``rollout.engine`` is validated against the engine registry (``ppoflow.infra.models.rollout_engines``), and
settings that need a capability the engine lacks (tensor parallelism, multi-turn) are refused here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ppoflow.infra.config.correction import RolloutCorrectionConfig
from ppoflow.infra.config.multiturn import MultiTurnConfig
from ppoflow.infra.config.names import (
    AdvEstimatorName,
    Dtype,
    EngineName,
    KLControllerKind,
    KLPenaltyKind,
    Section,
)
from ppoflow.infra.config.teacher import DistillConfig
from ppoflow.infra.models.rollout_engines import engine_spec

__all__ = ["RolloutConfig", "KLControlConfig", "DynamicSamplingConfig", "AlgorithmConfig", "DataConfig"]


class RolloutConfig(Section):
    engine: EngineName = Field(
        "vllm",
        description="the rollout engine (ppoflow.infra.models.rollout_engines): vllm, or hf (transformers "
        "generate) without vLLM",
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
    max_num_seqs: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="most sequences one engine decodes at once; auto = the engine's share of a training "
        "batch (data.train_batch_size x rollout.n over the engines, at most 1024), so a rollout decodes "
        "in one wave (on GPU the auto KV cache is sized to hold it)",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens per engine step (chunked prefill budget); None = vLLM's default. On CPU "
        "prefill is not chunked (whole prompts a step), so it must be at least prompt + response length",
    )
    enforce_eager: bool | None = Field(
        None, description="None: eager on CPU, CUDA graphs on GPU (faster decoding); or force it"
    )
    sleep_level: Literal[0, 1, 2] | None = Field(
        None,
        description="GPU: how the engine sleeps after each rollout to give its memory to training. "
        "2 discards weights and KV cache (nothing copied; the next rollout pushes the weights); 1 also "
        "frees the GPU but keeps the weights in host memory; 0 never sleeps (weights, KV cache and its "
        "prefix cache stay on the GPU). None: 2 when the engine shares its ranks with the trained actor "
        "(which pushes new weights before every rollout anyway), 1 when it serves LoRA adapters, else "
        "0 (an engine group of its own: the asynchronous producer, a standalone evaluation)",
    )
    weight_loader: Literal["hf", "dtensor"] = Field(
        "hf",
        description="FSDP -> engine push with TP > 1: hf (every rank gets full tensors, vLLM slices) or "
        "dtensor (each TP rank receives only its slices of the linear layers)",
    )
    calculate_log_probs: bool = Field(
        True,
        description="vLLM: also return the engine's log-prob of each sampled token (the "
        "rollout_log_probs column): the advantage task then measures the sampler/trainer mismatch "
        "every iteration (mismatch/*), and algorithm.rollout_correction can correct for it or use "
        "them as the behaviour policy. Costs part of vLLM's sampling rate (docs/algorithms.md, "
        "'Sampler vs trainer'); false turns both off. The HF engine always returns them",
    )
    seed: int = 0
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1)
    multi_turn: MultiTurnConfig = Field(
        default_factory=MultiTurnConfig, description="multi-turn episodes with an environment and tools"
    )

    @model_validator(mode="after")
    def _check_engine(self) -> RolloutConfig:
        """Settings that need a capability the engine lacks (``ppoflow.infra.models.rollout_engines``)."""
        spec = engine_spec(self.engine)
        if self.tensor_model_parallel_size > 1:
            setting = f"rollout.tensor_model_parallel_size={self.tensor_model_parallel_size}"
            spec.require("tensor_parallel", setting, "set it to 1")
        if self.multi_turn.enable:
            spec.require("multi_turn", "rollout.multi_turn.enable", "turn it off")
        return self

    @model_validator(mode="after")
    def _check_multi_turn(self) -> RolloutConfig:
        mt = self.multi_turn
        if mt.enable and self.tensor_model_parallel_size != 1:
            raise ValueError(
                "rollout.multi_turn runs its environments in each engine's rank: it needs "
                "rollout.tensor_model_parallel_size=1 (got "
                f"{self.tensor_model_parallel_size})"
            )
        if mt.enable and mt.max_turn_tokens is not None and mt.max_turn_tokens > self.response_length:
            raise ValueError(
                f"rollout.multi_turn.max_turn_tokens={mt.max_turn_tokens} exceeds the episode budget "
                f"rollout.response_length={self.response_length}: lower it or raise response_length"
            )
        return self

    def engine_seqs(self, sequences: int | None) -> int:
        """``max_num_seqs`` for an engine holding ``sequences`` of a batch (None: unknown, 256)."""
        if self.max_num_seqs != "auto":
            return self.max_num_seqs
        return max(1, min(1024, sequences or 256))


class KLControlConfig(Section):
    type: KLControllerKind = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


class DynamicSamplingConfig(Section):
    """DAPO's dynamic sampling: prompt groups whose responses all scored the same (no gradient
    signal under GRPO) are dropped, and ``generate`` samples more prompts, ``data.train_batch_size``
    per round, until the batch holds ``data.train_batch_size`` informative groups (the first ones,
    in data order; the rest of the last round is discarded). The data cursor moves past every
    prompt sampled. The score is the rule / custom-function score (no reward model)."""

    enable: bool = False
    max_rounds: int = Field(
        10,
        ge=1,
        description="most generation rounds per iteration; beyond it generate fails naming the shortfall",
    )


class AlgorithmConfig(Section):
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
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    distill: DistillConfig = Field(
        default_factory=DistillConfig,
        description="the distill estimator's per-token reward from the teacher (docs/distillation.md)",
    )
    filter_overlong_responses: bool = Field(
        False,
        description="DAPO's overlong filtering: responses cut at rollout.response_length get no "
        "loss (their response mask is zeroed in the training batch, after the advantages)",
    )
    overlap: Literal["none", "one_step"] = Field(
        "none",
        description="one_step: the rollout of iteration n uses the weights after update n-2, so it "
        "overlaps update n-1 (one step off-policy); none: strictly on-policy",
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="the behaviour policy and the sampler/trainer correction (TIS, MIS, bypass)",
    )


class DataConfig(Section):
    """The prompts. ``train_files`` and ``val_files`` take a list or one path (as veRL's); both are
    checked when the config is loaded (an empty training list, an empty entry) and their files by the
    preflight, before any rank starts (which also says when a file is in both lists)."""

    train_files: list[str] = Field(
        description="parquet files in veRL's format (paths, fsspec URLs, globs or directories); one "
        "path may be given without a list"
    )
    val_files: list[str] = Field(
        default_factory=list,
        description="held-out parquet files in the same format (evaluation section: when and how); one "
        "path may be given without a list",
    )
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

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        """One path as a list of one (veRL's ``data.train_files=PATH``)."""
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_files(self) -> DataConfig:
        if not self.train_files:
            raise ValueError(
                "data.train_files is empty: name at least one parquet file (a path, fsspec URL, glob "
                "or directory); an empty list is often a path or variable that expanded to nothing"
            )
        for field, files in (("data.train_files", self.train_files), ("data.val_files", self.val_files)):
            blank = [i for i, f in enumerate(files) if not f.strip()]
            if blank:
                raise ValueError(f"{field}[{blank[0]}] is an empty string: give a path or URL, or remove it")
        return self
