"""ppoflow.tasks: one Prefect task per step of a PPO iteration (inputs and outputs are URLs).

The iteration's steps, what each reads, where it runs and when, are one table:
:data:`ppoflow.tasks.graph.STEPS` (its picture is in docs/internals.md). Around them:

    preflight        checks data, models, reward, storage and checkpoints before anything starts
    init_experiment  iteration 0 of a new experiment (base-weight checkpoints, manifest 0)

and :data:`TASKS`, every step's Prefect task by the step's name (a step without a task, or a task
without a row, fails this import; each task's parameters were checked against its row as it was
decorated). ``ppoflow.tasks.run`` holds the flow-run-scoped state (worker groups, inputs) the
tasks look up by run key.
"""

from typing import Any

from prefect import Task

from ppoflow.tasks.advantage import advantage
from ppoflow.tasks.commit import commit, init_experiment
from ppoflow.tasks.consume import consume
from ppoflow.tasks.evaluate import evaluate
from ppoflow.tasks.generate import generate
from ppoflow.tasks.graph import STEPS
from ppoflow.tasks.preflight import preflight
from ppoflow.tasks.publish import publish_policy
from ppoflow.tasks.score import old_log_prob, ref_log_prob, rm_score, teacher_log_prob, values
from ppoflow.tasks.update import update_actor, update_critic

#: The Prefect task of every step of :data:`ppoflow.tasks.graph.STEPS`, by the step's name.
TASKS: dict[str, Task[..., Any]] = {
    t.name: t
    for t in (
        generate,
        consume,
        old_log_prob,
        ref_log_prob,
        teacher_log_prob,
        values,
        rm_score,
        advantage,
        update_actor,
        update_critic,
        publish_policy,
        evaluate,
        commit,
    )
}
_unlisted = {s.name for s in STEPS} ^ set(TASKS)
if _unlisted:  # a step without a task, or a task without a row: both are mistakes
    raise ImportError(
        f"ppoflow.tasks: steps and tasks disagree on {sorted(_unlisted)}: every row of "
        "ppoflow.tasks.graph.STEPS needs its task in TASKS, and every task its row"
    )

__all__ = [
    "TASKS",
    "advantage",
    "commit",
    "consume",
    "evaluate",
    "generate",
    "init_experiment",
    "old_log_prob",
    "preflight",
    "publish_policy",
    "ref_log_prob",
    "rm_score",
    "teacher_log_prob",
    "update_actor",
    "update_critic",
    "values",
]
