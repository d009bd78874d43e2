"""The teacher of on-policy distillation, on the actor group's ranks (docs/distillation.md).

A frozen ``PolicyLM`` of ``teacher.model``, built as the reference is (rank 0 reads the weights,
the others get shards; no optimizer, no adapters), sharded over the same ranks with the actor's
data layout: its sequence-parallel groups and packed micro-batches, so it scores each rank's share
of the rollout where that share already is. The worker holds one when its role carries the
``+teacher`` flag (``actor_rollout_ref+teacher``: ``ppoflow.tasks.graph.actor_group_role`` adds it
when the ``teacher_log_prob`` step runs).

    config, with_teacher = split_teacher_role(config)      # in the worker's __init__
    self._build_teacher(info, common)                        # in init_model, after the actor
    worker.compute_teacher_log_prob(data)                    # DP_COMPUTE_PROTO -> "teacher_log_prob"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.contracts import TEACHER_FLAG  # the suffix of a mode with the teacher
from ppoflow.infra.remote.rank.worker import Dispatch, register
from ppoflow.workers.actor import DataParallelPPOActor

if TYPE_CHECKING:
    from ppoflow.infra.config import ExperimentConfig

__all__ = ["TeacherMethods", "split_teacher_role", "TEACHER_FLAG"]


def split_teacher_role(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """A worker config whose ``role`` may end in :data:`TEACHER_FLAG`: the config with the plain
    role, and whether the flag was there."""
    role = config.get("role")
    if not isinstance(role, str) or not role.endswith(TEACHER_FLAG):
        return config, False
    return {**config, "role": role.removesuffix(TEACHER_FLAG)}, True


class TeacherMethods:
    """Mixin for the actor group's worker: builds the teacher (:meth:`_build_teacher`) and scores
    rollouts with it (:meth:`compute_teacher_log_prob`). The worker provides ``_build_policy``
    (a sharded ``PolicyLM`` of a model section), ``cfg``, ``is_actor`` and ``role``."""

    cfg: ExperimentConfig
    role: str
    is_actor: bool
    with_teacher: bool = False
    teacher: DataParallelPPOActor | None = None

    def _build_policy(self, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError

    def _build_teacher(self, info: dict[str, Any], common: dict[str, Any]) -> None:
        """Build the teacher when the role carries the flag (its layout goes into ``info["teacher"]``);
        ``common``: the keyword arguments every ``DataParallelPPOActor`` of the worker gets."""
        if not self.with_teacher:
            return
        teacher = self.cfg.teacher
        if teacher is None or not self.is_actor:
            raise ValueError(
                f"role {self.role + TEACHER_FLAG!r}: the teacher is built beside a trained actor, from "
                "the config's teacher section"
                + ("" if teacher is not None else ", which is null: set teacher.model.path")
            )
        packed = self.cfg.actor.use_dynamic_bsz  # the actor's layout: its packed micro-batches
        module, info["teacher"] = self._build_policy(
            teacher.fsdp, trainable=False, packed=packed, adapters=False, model=teacher.model
        )
        self.teacher = DataParallelPPOActor(
            self.cfg.actor,
            module,
            **common,
            log_prob_micro_batch_size=teacher.log_prob_micro_batch_size_per_gpu,
            log_prob_use_dynamic_bsz=packed,
            log_prob_max_token_len=teacher.log_prob_max_token_len_per_gpu,
            log_prob_section="teacher",
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """``teacher_log_prob`` (B, R): the teacher's log-probs of ``responses``, at the rollout's
        temperature as the policy's (0 off the response mask)."""
        if self.teacher is None:
            raise RuntimeError(
                f"teacher is not available in role {self.role!r}: the actor group holds one when the "
                "config has a teacher section (or init_model was not called)"
            )
        log_probs, _ = self.teacher.compute_log_prob(data)
        return DataProto.from_dict({"teacher_log_prob": log_probs})
