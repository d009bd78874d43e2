"""A flow run's state, shared by its tasks under the run's key: worker groups, inputs, writes.

    ctx = open_run(key, cfg)         # the flow, once per run
    ctx = get_run(key)               # a task
    ctx.groups.worker("critic", checkpoint).compute_values(url, out_url=...)

context.py      the run's context and its registry by run key (in the flow's process)
rollouts.py     where the run's rollouts come from (RolloutSource; the synchronous one)
groups.py       starting, rebuilding and loading the worker groups
making.py       the worker class of each role, and how a group is made (launcher, hub)
inputs.py       what the run reads once: the policy's tokenizer and the prompt dataset
materialize.py  a committed iteration's state written out as a checkpoint
"""

from ppoflow.tasks.run.context import RunContext, abort_run, close_run, get_run, open_run, worker_groups
from ppoflow.tasks.run.groups import DEFAULT_BUILDS, WORKERS, RunClosed, RunGroups
from ppoflow.tasks.run.rollouts import SYNCHRONOUS, RolloutSource, SynchronousRollouts

__all__ = [
    "RunContext",
    "RolloutSource",
    "SynchronousRollouts",
    "SYNCHRONOUS",
    "RunGroups",
    "RunClosed",
    "open_run",
    "get_run",
    "close_run",
    "abort_run",
    "worker_groups",
    "WORKERS",
    "DEFAULT_BUILDS",
]
