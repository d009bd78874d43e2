"""``update_actor`` and ``update_critic``: PPO epochs on the training batch, then a checkpoint.

Each runs on its own group (so the flow runs them concurrently): make sure the live module equals
the checkpoint of iteration n-1 (a rebuilt or dirty group loads it), run the update on
``advantages.arrow`` (metrics: the mean over ranks), save the sharded checkpoint
``checkpoints/<role>/{n:06d}/`` and write the receipt. A retry after a failure anywhere in between
reloads n-1 and updates again, so it ends in the same weights as a run that never failed.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.infra.runtime.faults import maybe_fail
from ppoflow.tasks.common import TASK_OPTIONS, Timer, find_receipt, task_logs, write_receipt
from ppoflow.tasks.runtime import get_run

__all__ = ["update_actor", "update_critic"]


def _update(
    run: str, n: int, name: str, role: str, advantages: dict[str, Any], previous_checkpoint: str
) -> dict[str, Any]:
    ctx = get_run(run)
    done = find_receipt(ctx, n, name)
    if done is not None:
        return done
    maybe_fail(name, "before")
    checkpoint = ctx.paths.checkpoint(role, n)
    with task_logs(ctx, role) as logger, Timer() as timer:
        ctx.group(role, previous_checkpoint, progress=logger.info)
        ctx.set_state(role, None)  # the live module leaves checkpoint n-1 from here on
        per_rank = ctx.call(role, name, advantages["outputs"]["advantages"])
        metrics = reduce_rank_metrics(per_rank)
        with Timer() as save:
            ctx.call(
                role,
                "save_checkpoint",
                checkpoint,
                extra={"iteration": n, "experiment": ctx.cfg.storage.experiment},
            )
        ctx.set_state(role, checkpoint)
    metrics[f"timing_s/save_checkpoint_{role}"] = save.seconds
    receipt = write_receipt(
        ctx, n, name, outputs={}, checkpoints={role: checkpoint}, metrics=metrics, timing_s=timer.seconds
    )
    maybe_fail(name, "after")
    return receipt


@task(name="update_actor", task_run_name="update_actor-{n}", **TASK_OPTIONS)
def update_actor(run: str, n: int, advantages: dict[str, Any], actor_checkpoint: str) -> dict[str, Any]:
    """PPO policy update from ``actor_checkpoint`` (n-1); saves ``checkpoints/actor/n``."""
    return _update(run, n, "update_actor", "actor", advantages, actor_checkpoint)


@task(name="update_critic", task_run_name="update_critic-{n}", **TASK_OPTIONS)
def update_critic(run: str, n: int, advantages: dict[str, Any], critic_checkpoint: str) -> dict[str, Any]:
    """Value update from ``critic_checkpoint`` (n-1); saves ``checkpoints/critic/n``."""
    return _update(run, n, "update_critic", "critic", advantages, critic_checkpoint)
