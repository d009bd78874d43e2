"""The settings a config may leave to ppoflow, filled in from the rest of it when it is loaded.

A config that names only its model, data and estimator gets the fast path: what veRL users must
ask for (``use_dynamic_bsz``, token budgets, bf16 compute, a critic only for GAE) is the default
here, decided once, in :func:`resolve_defaults`, from the other sections:

- ``critic.enable`` null: on exactly when ``algorithm.adv_estimator`` reads values (``gae``); an
  explicit ``true`` with an estimator that reads none is refused (a critic nothing reads);
- ``critic.use_dynamic_bsz`` and ``reward.reward_model.use_dynamic_bsz`` null: the actor's, which
  defaults to packed micro-batches (``ref.log_prob_use_dynamic_bsz`` follows it where it is used);
- ``ppo_max_token_len_per_gpu: auto`` (actor and critic): :data:`AUTO_UPDATE_TOKENS`, or the
  longest row when that is longer (a budget must hold one row; with sequence parallelism, one
  rank's share of it). The log-prob and values passes default to twice the update's budget where
  they are used (``ppoflow.workers``): a forward keeps no activations for a backward;
- with ``resources.device: cuda``: bf16 compute over float32 master weights
  (``fsdp.param_dtype``) in every group, a bf16 engine (``rollout.dtype``), ``torch.compile``
  (``use_torch_compile``, off with LoRA, which cannot follow it) and the fused LM head
  (``actor.logprob_head``); on CPU the model's dtype, no compile and the checkpointed head, as
  measured fastest there.

What a config sets itself is kept as it is; the resolved config (what ``model_dump`` writes, what
the ranks and the manifest see) holds the chosen values, never ``null``/``auto`` for these.
"""

from __future__ import annotations

from typing import Protocol

from ppoflow.infra.config.iteration import AlgorithmConfig, RolloutConfig
from ppoflow.infra.config.models import (
    AUTO_UPDATE_TOKENS,
    ActorConfig,
    CriticConfig,
    ModelConfig,
    RefConfig,
    RewardConfig,
)
from ppoflow.infra.config.system import ResourcesConfig

__all__ = ["resolve_defaults", "AUTO_UPDATE_TOKENS"]


class _Sections(Protocol):
    """What :func:`resolve_defaults` reads and fills of an ``ExperimentConfig``."""

    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    critic: CriticConfig
    reward: RewardConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    resources: ResourcesConfig

    @property
    def critic_model(self) -> ModelConfig: ...


def resolve_defaults(cfg: _Sections) -> None:
    """Fill ``cfg``'s null and ``auto`` settings (see the module docstring), in place;
    ValueError for ``critic.enable: true`` with an estimator that reads no values."""
    _critic(cfg)
    actor, critic = cfg.actor, cfg.critic
    if critic.use_dynamic_bsz is None:
        critic.use_dynamic_bsz = actor.use_dynamic_bsz
    rm = cfg.reward.reward_model
    if rm.use_dynamic_bsz is None:
        rm.use_dynamic_bsz = actor.use_dynamic_bsz
    longest = cfg.rollout.prompt_length + cfg.rollout.response_length
    for section in (actor, critic):
        if section.ppo_max_token_len_per_gpu == "auto":
            per_rank = -(-longest // section.sequence_parallel_size)
            section.ppo_max_token_len_per_gpu = max(AUTO_UPDATE_TOKENS, per_rank)
    _device_defaults(cfg)


def _critic(cfg: _Sections) -> None:
    """``critic.enable`` from the estimator (module docstring)."""
    from ppoflow.algos import ADV_ESTIMATORS, estimator_reads_values

    estimator = cfg.algorithm.adv_estimator
    reads = estimator_reads_values(estimator)
    if cfg.critic.enable is None:
        cfg.critic.enable = reads
    elif cfg.critic.enable and not reads:
        users = sorted(n for n in ADV_ESTIMATORS if estimator_reads_values(n))
        raise ValueError(
            f"critic.enable=true with algorithm.adv_estimator='{estimator}', which reads no values: "
            "the critic would be trained every iteration (an update, a values pass and a checkpoint) "
            "and nothing would read it. Remove critic.enable (it follows the estimator) or set it to "
            f"false; or pick an estimator that uses a critic ({', '.join(users)})"
        )


def _device_defaults(cfg: _Sections) -> None:
    """Dtypes and kernels by ``resources.device`` (module docstring)."""
    cuda = cfg.resources.device == "cuda"
    lora = cfg.actor.lora.enabled or cfg.critic.lora.enabled
    models: list[ModelConfig] = [cfg.model]
    models += [m for m in (cfg.critic.model, cfg.reward.reward_model.model) if m is not None]
    for model in models:
        if model.use_torch_compile is None:
            model.use_torch_compile = cuda and not lora
    if cfg.actor.logprob_head is None:
        cfg.actor.logprob_head = "fused" if cuda else "checkpoint"
    if not cuda:
        return
    rm = cfg.reward.reward_model
    groups = [(cfg.actor.fsdp, cfg.model), (cfg.ref.fsdp, cfg.model), (cfg.critic.fsdp, cfg.critic_model)]
    groups += [(rm.fsdp, rm.model)] if rm.model is not None else []
    for fsdp, model in groups:
        if fsdp.param_dtype is None and model.dtype == "float32":
            fsdp.param_dtype = "bfloat16"
    if cfg.rollout.dtype is None:
        cfg.rollout.dtype = "bfloat16" if cfg.model.dtype == "float32" else cfg.model.dtype
