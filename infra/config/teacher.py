"""``teacher`` and ``algorithm.distill``: on-policy distillation (docs/distillation.md).

The student (the trained policy) samples; a frozen teacher scores every sampled token with its
log-probability (the ``teacher_log_prob`` step); the student is trained toward the teacher by the
per-token reverse KL, as a dense reward (``algorithm.adv_estimator: distill`` with
``algorithm.distill``) or as a loss term beside a task reward (``actor.teacher_kl_coef``).

    teacher:
      model: {path: runs/teacher}             # shares the student's tokenizer (checked in preflight)
      log_prob_micro_batch_size_per_gpu: 8
    algorithm: {adv_estimator: distill, distill: {coef: 1.0, gamma: 0.0}}

The teacher is built on the actor group's ranks, sharded like the reference, with the actor's
data layout (its sequence parallelism and packed micro-batches).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ppoflow.infra.config.models import FSDPConfig, ModelConfig
from ppoflow.infra.config.names import Section

__all__ = ["TeacherConfig", "DistillConfig", "resolve_teacher", "check_teacher", "teacher_in_use"]


class TeacherConfig(Section):
    """A frozen model on the actor group's ranks whose log-probs of the sampled tokens the student
    is trained toward (module docstring)."""

    model: ModelConfig
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    log_prob_micro_batch_size_per_gpu: int = Field(8, ge=1, description="rows per teacher forward (padded)")
    log_prob_max_token_len_per_gpu: int | None = Field(
        None,
        ge=1,
        description="with actor.use_dynamic_bsz: tokens per packed teacher forward; null: the actor's "
        "log-prob token budget",
    )


class DistillConfig(Section):
    """The dense reward of ``algorithm.adv_estimator: distill``:
    ``r_t = coef * (log pi_teacher(y_t) - log pi(y_t))`` per response token, and the advantage is
    its discounted return with ``gamma``, no baseline."""

    coef: float = Field(1.0, gt=0.0, description="the reward's scale: coef x the per-token reverse KL")
    gamma: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="discount of the per-token rewards (0: each token's own; 1: the sum to the end of "
        "the response). The distill estimator's own: algorithm.gamma is GAE's and REINFORCE++'s",
    )


def teacher_in_use(cfg: Any) -> bool:
    """Whether something reads the teacher's log-probs: the ``distill`` estimator's reward or the
    actor's teacher-KL loss term."""
    return cfg.algorithm.adv_estimator == "distill" or cfg.actor.teacher_kl_coef > 0


def resolve_teacher(cfg: Any) -> None:
    """The teacher's null settings, as the policy's are resolved (``infra.config.defaults``): with
    ``resources.device: cuda`` bf16 compute over float32 weights and ``torch.compile``; on CPU the
    model's dtype, no compile."""
    teacher = cfg.teacher
    if teacher is None:
        return
    cuda = cfg.resources.device == "cuda"
    if teacher.model.use_torch_compile is None:
        teacher.model.use_torch_compile = cuda
    if cuda and teacher.fsdp.param_dtype is None and teacher.model.dtype == "float32":
        teacher.fsdp.param_dtype = "bfloat16"


def check_teacher(cfg: Any) -> None:
    """The teacher against what reads it (a ValueError naming the fix): the ``distill`` estimator
    and the teacher-KL loss need one; a teacher nothing reads is refused (it would cost a model on
    every rank and a forward each iteration); its shard size and token budget fit the actor's
    ranks and longest row."""
    teacher, actor = cfg.teacher, cfg.actor
    if teacher is None:
        if cfg.algorithm.adv_estimator == "distill":
            raise ValueError(
                "algorithm.adv_estimator='distill' rewards the student by a teacher's log-probs: "
                "set teacher.model.path"
            )
        if actor.teacher_kl_coef > 0:
            raise ValueError(
                f"actor.teacher_kl_coef={actor.teacher_kl_coef:g} is a KL to a teacher: set "
                "teacher.model.path, or set actor.teacher_kl_coef to 0"
            )
        return
    if not teacher_in_use(cfg):
        raise ValueError(
            "teacher is set, but nothing reads its log-probs: use algorithm.adv_estimator='distill' "
            "(recipe: distill) or actor.teacher_kl_coef > 0 (recipe: distill+rl), or remove teacher"
        )
    n = cfg.resources.nprocs
    size = teacher.fsdp.fsdp_size
    if size != -1 and (size < 1 or n % size):
        raise ValueError(f"teacher.fsdp.fsdp_size={size} must be -1 or a divisor of resources.nprocs={n}")
    budget = teacher.log_prob_max_token_len_per_gpu
    longest = cfg.rollout.prompt_length + cfg.rollout.response_length
    sp = actor.sequence_parallel_size
    if actor.use_dynamic_bsz and budget is not None and budget * sp < longest:
        raise ValueError(
            f"teacher.log_prob_max_token_len_per_gpu={budget} is smaller than the longest row: "
            f"rollout.prompt_length + rollout.response_length = {longest} tokens; raise it to at "
            f"least {-(-longest // sp)}"
        )
