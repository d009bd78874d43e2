"""The independent reads of a rollout: ``old_log_prob``, ``ref_log_prob``, ``teacher_log_prob``,
``values``, ``rm_score``.

Each runs one DP_COMPUTE_PROTO method on its worker group and writes one DataProto with the new
column(s) only, under ``iterations/{n:06d}/``:

    old_log_prob      actor group   compute_log_prob          -> old_log_prob.arrow  ("old_log_probs")
    ref_log_prob      actor group   compute_ref_log_prob      -> ref_log_prob.arrow  ("ref_log_prob")
    teacher_log_prob  actor group   compute_teacher_log_prob  -> teacher_log_prob.arrow
    values            critic group  compute_values            -> values.arrow        ("values")
    rm_score          reward group  compute_rm_score          -> rm_scores.arrow     ("rm_scores")

The flow submits them together; those on different groups run concurrently. ``old_log_prob`` runs
with asynchronous training only (``generate`` recomputes them otherwise): the actor of iteration
n-1 scores the consumed batch, the rows of each rank and its micro-batches as ``generate`` would
have them, so with ``max_staleness: 0`` the values are bit for bit the synchronous flow's.
"""

from __future__ import annotations

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.tasks.receipts import GenerateReceipt, Receipt
from ppoflow.tasks.step import Step, ppo_task

__all__ = ["old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score"]


@ppo_task("old_log_prob", roles=("actor",))
def old_log_prob(step: Step[Receipt], generated: GenerateReceipt, actor_checkpoint: str) -> Receipt:
    """The PPO ratio's denominator of the consumed rollout: the log-probs of the actor of
    ``actor_checkpoint`` (n-1; decoupled PPO's proximal policy), or with
    ``algorithm.rollout_correction.behaviour: sampler`` a copy of the sampler's own."""
    out = step.file("old_log_prob.arrow")
    rollout = generated.output("rollout")
    if step.cfg.algorithm.rollout_correction.behaviour == "sampler":
        sampled = DataProto.load(rollout, columns=["rollout_log_probs"])
        DataProto.from_dict({"old_log_probs": sampled.batch["rollout_log_probs"].float().clone()}).save(out)
    else:
        step.worker("actor", actor_checkpoint).compute_log_prob(rollout, out_url=out)
    return step.receipt(outputs={"old_log_prob": out})


@ppo_task("ref_log_prob", roles=("actor",))
def ref_log_prob(step: Step[Receipt], generated: GenerateReceipt) -> Receipt:
    """Log-probs of the sampled responses under the frozen reference policy."""
    out = step.file("ref_log_prob.arrow")
    step.worker("actor").compute_ref_log_prob(generated.output("rollout"), out_url=out)
    return step.receipt(outputs={"ref_log_prob": out})


@ppo_task("teacher_log_prob", roles=("actor",))
def teacher_log_prob(step: Step[Receipt], generated: GenerateReceipt) -> Receipt:
    """Log-probs of the sampled responses under the frozen teacher (on-policy distillation)."""
    out = step.file("teacher_log_prob.arrow")
    step.worker("actor").compute_teacher_log_prob(generated.output("rollout"), out_url=out)
    return step.receipt(outputs={"teacher_log_prob": out})


@ppo_task("values", roles=("critic",))
def values(step: Step[Receipt], generated: GenerateReceipt, critic_checkpoint: str) -> Receipt:
    """The critic's values of the rollout, with the critic of ``critic_checkpoint`` (n-1)."""
    out = step.file("values.arrow")
    step.worker("critic", critic_checkpoint).compute_values(generated.output("rollout"), out_url=out)
    return step.receipt(outputs={"values": out})


@ppo_task("rm_score", roles=("reward_model",))
def rm_score(step: Step[Receipt], generated: GenerateReceipt) -> Receipt:
    """The reward model's score of each response (on its last token)."""
    out = step.file("rm_scores.arrow")
    step.worker("reward_model").compute_rm_score(generated.output("rollout"), out_url=out)
    return step.receipt(outputs={"rm_score": out})
