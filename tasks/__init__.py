"""ppoflow.tasks: one Prefect task per step of a PPO iteration (inputs and outputs are URLs).

    preflight        checks data, models, reward, storage and checkpoints before anything starts
    init_experiment  iteration 0 of a new experiment (base-weight checkpoints, manifest 0)
    generate         prompts -> rollout.arrow (responses, rollout and old log-probs)
    ref_log_prob     rollout -> ref_log_prob.arrow
    values           rollout -> values.arrow
    rm_score         rollout -> rm_scores.arrow
    advantage        -> advantages.arrow (scores, KL penalty, advantages, returns; CPU)
    update_actor     -> checkpoints/actor/n
    update_critic    -> checkpoints/critic/n
    evaluate         -> iterations/n/eval/val/ (held-out generations, val/* metrics)
    commit           -> metrics.json, manifest n

``ppoflow.tasks.run`` holds the flow-run-scoped state (worker groups, inputs) the tasks look up by run key.
"""

from ppoflow.tasks.advantage import advantage
from ppoflow.tasks.commit import commit, init_experiment
from ppoflow.tasks.evaluate import evaluate
from ppoflow.tasks.generate import generate
from ppoflow.tasks.preflight import preflight
from ppoflow.tasks.score import ref_log_prob, rm_score, values
from ppoflow.tasks.update import update_actor, update_critic

__all__ = [
    "advantage",
    "commit",
    "evaluate",
    "generate",
    "init_experiment",
    "preflight",
    "ref_log_prob",
    "rm_score",
    "update_actor",
    "update_critic",
    "values",
]
