"""The experiment config: every section, and the checks that span sections."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import Field, model_validator

from ppoflow.infra.config.asynchronous import AsyncConfig, check_asynchronous
from ppoflow.infra.config.correction import check_rollout_correction
from ppoflow.infra.config.defaults import resolve_defaults
from ppoflow.infra.config.evaluation import EvaluationConfig
from ppoflow.infra.config.iteration import AlgorithmConfig, DataConfig, RolloutConfig
from ppoflow.infra.config.models import ActorConfig, CriticConfig, ModelConfig, RefConfig, RewardConfig
from ppoflow.infra.config.names import RecipeName, Section
from ppoflow.infra.config.recipes import apply_recipe
from ppoflow.infra.config.system import CheckpointConfig, ResourcesConfig, StorageConfig
from ppoflow.infra.config.teacher import TeacherConfig, check_teacher, resolve_teacher
from ppoflow.infra.config.tracking import TrackingConfig
from ppoflow.infra.models.rollout_engines import engine_spec

__all__ = ["ExperimentConfig"]


class ExperimentConfig(Section):
    recipe: RecipeName | None = Field(
        None,
        description="a named recipe (ppo, grpo, grpo_token_mean, dr_grpo, dapo, gspo, cispo, rloo, "
        "reinforce_plus_plus, distill, distill+rl) whose settings fill in what the config does not set "
        "(docs/algorithms.md)",
    )
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    teacher: TeacherConfig | None = Field(
        None,
        description="a frozen model the policy is distilled toward, on the actor group's ranks "
        "(docs/distillation.md); null: none",
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    asynchronous: AsyncConfig = Field(
        default_factory=AsyncConfig,
        description="training that does not wait for generation: a staleness-bounded queue of "
        "rollouts on storage between a producer flow and the trainer (docs/async.md)",
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data: Any) -> Any:
        return apply_recipe(data)

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        resolve_defaults(self)  # first: the checks below read the resolved settings
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
        reward = self.reward
        # a teacher is a source; the distill estimator's reward is one (_check_teacher asks for it)
        teacher = self.teacher is not None or self.algorithm.adv_estimator == "distill"
        sources = (reward.rule, reward.reward_model.enable, reward.custom_function, reward.remote, teacher)
        if not any(sources):
            raise ValueError(
                "no reward source: enable reward.rule, reward.custom_function, reward.remote or "
                "reward.reward_model, or distill from a teacher"
            )
        if self.reward.reward_model.enable and self.reward.reward_model.model is None:
            raise ValueError("reward.reward_model.enable=true needs reward.reward_model.model.path")
        return self

    @model_validator(mode="after")
    def _check_dapo(self) -> ExperimentConfig:
        """DAPO's settings need what they read: groups of responses, scores at generation, room."""
        if self.algorithm.dynamic_sampling.enable:
            if self.rollout.n < 2:
                raise ValueError(
                    "algorithm.dynamic_sampling compares the responses to one prompt: set rollout.n >= 2"
                )
            if self.reward.reward_model.enable:
                raise ValueError(
                    "algorithm.dynamic_sampling scores responses while generating, with the rule or "
                    "custom function only: disable reward.reward_model or dynamic sampling"
                )
        buffer, limit = self.reward.overlong_buffer, self.rollout.response_length
        if buffer.enable and buffer.length is not None and buffer.length > limit:
            raise ValueError(
                f"reward.overlong_buffer.length={buffer.length} exceeds rollout.response_length="
                f"{limit}: the buffer is the last part of the response length; make it at most {limit}"
            )
        return self

    @model_validator(mode="after")
    def _check_rollout_correction(self) -> ExperimentConfig:
        """``algorithm.rollout_correction`` against the rollout and the policy loss."""
        r = self.rollout
        check_rollout_correction(
            self.algorithm.rollout_correction,
            engine=r.engine,
            calculate_log_probs=r.calculate_log_probs,
            top_p=r.top_p,
            top_k=r.top_k,
            policy_loss=self.actor.policy_loss,
            response_length=r.response_length,
        )
        return self

    @model_validator(mode="after")
    def _check_teacher(self) -> ExperimentConfig:
        """The teacher's null settings resolved, and the teacher against what reads it."""
        resolve_teacher(self)
        check_teacher(self)
        return self

    @model_validator(mode="after")
    def _check_asynchronous(self) -> ExperimentConfig:
        check_asynchronous(self)
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> ExperimentConfig:
        """LoRA's settings against the engine and the model's other options."""
        lora = self.actor.lora
        on = [name for name, cfg in (("actor", lora), ("critic", self.critic.lora)) if cfg.enabled]
        if on and self.model.use_torch_compile:
            raise ValueError(
                f"{on[0]}.lora with model.use_torch_compile: the adapters are injected after the "
                "layers are compiled; turn one of them off"
            )
        if not lora.enabled:
            return self
        engine = engine_spec(self.rollout.engine)
        if engine.max_lora_rank is not None and lora.rank > engine.max_lora_rank:
            raise ValueError(
                f"actor.lora.rank={lora.rank}: rollout.engine={engine.name!r} serves adapters of "
                f"rank <= {engine.max_lora_rank}"
            )
        if not engine.can("weight_push"):
            return self  # it generates with the actor's module, adapters and all: nothing to sync
        if self.rollout.weight_loader == "dtensor":
            raise ValueError(
                "actor.lora with rollout.weight_loader=dtensor: the pre-sliced push is for full "
                "weights; use weight_loader=hf (an adapter is small; merged weights go the hf way)"
            )
        if lora.sync == "adapter":
            engine.require("adapter_sync", "actor.lora.sync=adapter", "use actor.lora.sync=merged")
        if lora.sync == "adapter" and engine.can("sleep") and self.rollout.sleep_level == 2:
            raise ValueError(
                "actor.lora.sync=adapter keeps the base weights in the engine, but rollout.sleep_level=2 "
                "discards them after every rollout: set rollout.sleep_level to 1 (or null), or "
                "actor.lora.sync=merged"
            )
        return self

    def producer_config(self) -> ExperimentConfig:
        """This config as the rollout producer's flow runs it: ``resources`` with
        ``asynchronous.producer``'s placement (its group's ranks always on the flow's host)."""
        p = self.asynchronous.producer
        res = self.resources
        resources = res.model_copy(
            update={
                "launch": "local",
                "nprocs": p.nprocs or res.nprocs,
                "device": p.device or res.device,
                "visible_devices": p.visible_devices or res.visible_devices,
                "threads_per_rank": p.threads_per_rank or res.threads_per_rank,
            }
        )
        return self.model_copy(update={"resources": resources})

    def overlong_buffer_length(self) -> int:
        """The overlong buffer in tokens (its ``length``, else a fifth of the response length)."""
        length = self.reward.overlong_buffer.length
        return length if length is not None else max(1, self.rollout.response_length // 5)

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> ExperimentConfig:
        """``sequence_parallel_size`` divides the ranks and splits packed micro-batches only."""
        n = self.resources.nprocs
        ref_sp = self.ref.sequence_parallel_size or self.actor.sequence_parallel_size
        ref_packed = self.ref.log_prob_use_dynamic_bsz
        ref_packed = self.actor.use_dynamic_bsz if ref_packed is None else ref_packed
        sections = [
            ("actor", self.actor.sequence_parallel_size, self.actor.use_dynamic_bsz, "actor.use_dynamic_bsz"),
            ("ref", ref_sp, ref_packed, "ref.log_prob_use_dynamic_bsz"),
        ]
        if self.critic.enable:
            sections.append(
                (
                    "critic",
                    self.critic.sequence_parallel_size,
                    self.critic.packed,
                    "critic.use_dynamic_bsz",
                )
            )
        for name, size, packed, packed_field in sections:
            if n % size:
                raise ValueError(f"{name}.sequence_parallel_size={size} must divide resources.nprocs={n}")
            if size > 1 and not packed:
                raise ValueError(
                    f"{name}.sequence_parallel_size={size} splits packed micro-batches only: set "
                    f"{packed_field}=true"
                )
        return self

    @model_validator(mode="after")
    def _check_token_budgets(self) -> ExperimentConfig:
        """With use_dynamic_bsz every token budget must hold the longest rollout row (with
        sequence parallelism: sequence_parallel_size budgets, one per rank of a group); on CPU the
        engine's step budget, when set, holds its longest sequence (prefill is not chunked there)."""
        longest = self.rollout.prompt_length + self.rollout.response_length
        actor_sp = self.actor.sequence_parallel_size
        ref_sp = self.ref.sequence_parallel_size or actor_sp
        critic_sp = self.critic.sequence_parallel_size
        budgets: list[tuple[str, int | None, int]] = []
        if self.actor.use_dynamic_bsz:
            budgets.append(("actor.ppo_max_token_len_per_gpu", self.actor.update_tokens, actor_sp))
        if self.actor.use_dynamic_bsz or self.ref.log_prob_use_dynamic_bsz:
            budgets.append(
                ("actor.log_prob_max_token_len_per_gpu", self.actor.log_prob_max_token_len_per_gpu, actor_sp)
            )
            budgets.append(
                ("ref.log_prob_max_token_len_per_gpu", self.ref.log_prob_max_token_len_per_gpu, ref_sp)
            )
        if self.critic.enable and self.critic.use_dynamic_bsz:
            budgets.append(("critic.ppo_max_token_len_per_gpu", self.critic.update_tokens, critic_sp))
            budgets.append(
                ("critic.forward_max_token_len_per_gpu", self.critic.forward_max_token_len_per_gpu, critic_sp)
            )
        step, held = self.rollout.max_num_batched_tokens, self.engine_max_model_len()
        if (
            self.resources.device == "cpu"
            and engine_spec(self.rollout.engine).can("step_budget")
            and step is not None
            and step < held
        ):
            raise ValueError(
                f"rollout.max_num_batched_tokens={step} is smaller than the engine's longest sequence, "
                f"{held} tokens (rollout.prompt_length + the longer of the training and evaluation "
                "responses): on CPU vLLM prefills whole prompts a step; raise it or leave it unset"
            )
        for name, budget, sp in budgets:
            if budget is not None and budget * sp < longest:
                need = -(-longest // sp)
                split = f" / sequence_parallel_size {sp}" if sp > 1 else ""
                raise ValueError(
                    f"{name}={budget} is smaller than the longest row: rollout.prompt_length + "
                    f"rollout.response_length = {longest} tokens{split}; raise it to at least {need}"
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

    @property
    def engine_dtype(self) -> str:
        """The rollout engine's dtype: ``rollout.dtype``, else the model's (what sampling and
        evaluation run in, and what another program must use to decode as they do)."""
        return self.rollout.dtype or self.model.dtype

    @property
    def policy_version_dtype(self) -> str | None:
        """The dtype asynchronous training publishes policy versions in: the engine's, when the
        producers' engines take them by a weight push into a narrower dtype than the trained
        model's (their load rounds each weight to nearest in that dtype, as the cast here does: the
        same weights, half the bytes to write and read); None (the model's own) otherwise."""
        narrower = self.model.dtype == "float32" and self.engine_dtype in ("bfloat16", "float16")
        if narrower and engine_spec(self.rollout.engine).can("weight_push"):
            return self.engine_dtype
        return None

    def engine_max_model_len(self) -> int:
        """The longest sequence the rollout engine holds: a prompt and the longer of a training
        response and an evaluation's (``evaluation.response_length``, which may be the longer)."""
        return self.rollout.prompt_length + max(
            self.rollout.response_length, self.evaluation.response_length or 0
        )

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
