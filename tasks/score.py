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
from ppoflow.infra.remote.contracts import ACTOR_ROLE, CRITIC_ROLE, REWARD_MODEL_ROLE
from ppoflow.tasks.receipts import GenerateReceipt, Receipt
from ppoflow.tasks.step import Step, ppo_task

__all__ = ["old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score"]


@ppo_task("old_log_prob")
def old_log_prob(step: Step[Receipt], generate: GenerateReceipt, actor: str) -> Receipt:
    """The PPO ratio's denominator of the consumed rollout: the log-probs of the actor of
    ``actor`` (n-1; decoupled PPO's proximal policy), or with
    ``algorithm.rollout_correction.behaviour: sampler`` a copy of the sampler's own."""
    out = step.file("old_log_prob.arrow")
    rollout = generate.output("rollout")
    if step.cfg.algorithm.rollout_correction.behaviour == "sampler":
        sampled = DataProto.load(rollout, columns=["rollout_log_probs"])
        DataProto.from_dict({"old_log_probs": sampled.batch["rollout_log_probs"].float().clone()}).save(out)
    else:
        step.worker(ACTOR_ROLE, actor).compute_log_prob(rollout, out_url=out)
    return step.receipt(outputs={step.output_key: out})


@ppo_task("ref_log_prob")
def ref_log_prob(step: Step[Receipt], generate: GenerateReceipt) -> Receipt:
    """Log-probs of the sampled responses under the frozen reference policy."""
    out = step.file("ref_log_prob.arrow")
    step.worker(ACTOR_ROLE).compute_ref_log_prob(generate.output("rollout"), out_url=out)
    return step.receipt(outputs={step.output_key: out})


@ppo_task("teacher_log_prob")
def teacher_log_prob(step: Step[Receipt], generate: GenerateReceipt) -> Receipt:
    """Log-probs of the sampled responses under the frozen teacher (on-policy distillation)."""
    out = step.file("teacher_log_prob.arrow")
    step.worker(ACTOR_ROLE).compute_teacher_log_prob(generate.output("rollout"), out_url=out)
    return step.receipt(outputs={step.output_key: out})


@ppo_task("values")
def values(step: Step[Receipt], generate: GenerateReceipt, rollout_critic: str) -> Receipt:
    """The critic's values of the rollout, with the critic of ``rollout_critic`` (n-1; n-2 with
    one-step overlap)."""
    out = step.file("values.arrow")
    step.worker(CRITIC_ROLE, rollout_critic).compute_values(generate.output("rollout"), out_url=out)
    return step.receipt(outputs={step.output_key: out})


@ppo_task("rm_score")
def rm_score(step: Step[Receipt], generate: GenerateReceipt) -> Receipt:
    """The reward model's score of each response (on its last token)."""
    out = step.file("rm_scores.arrow")
    step.worker(REWARD_MODEL_ROLE).compute_rm_score(generate.output("rollout"), out_url=out)
    return step.receipt(outputs={step.output_key: out})
