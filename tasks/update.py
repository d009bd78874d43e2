"""``update_actor`` and ``update_critic``: PPO epochs on the training batch, then a checkpoint.

Each runs on its own group (so the flow runs them concurrently): make sure the live module equals
the checkpoint of iteration n-1 (a rebuilt or dirty group loads it), run the update on
``advantages.arrow`` (metrics: the mean over ranks), hand the state to checkpoint
``checkpoints/<role>/{n:06d}/`` and write the receipt. A retry after a failure anywhere in between
reloads n-1 and updates again, so it ends in the same weights as a run that never failed.

With ``checkpoint.async_save`` (the default) the task returns once the state is staged in host
memory; the group writes it in the background while the next iteration runs.

Only every ``checkpoint.snapshot_every``-th iteration, and the last of each run (``snapshot``),
writes its state (a snapshot): a finished run leaves a state that loads without replay. Any other
iteration writes nothing: its receipt records how the state came about (the state it started
from, the batch, the method), and a run that needs the state later rebuilds it by replaying the
updates since the snapshot (:mod:`ppoflow.tasks.replay`).

Who waits for a write: with ``snapshot_every: 1`` every state is written and ``commit n`` waits
for checkpoint n (a receipt counts as done only while its checkpoint is complete, so a rerun after
a crash mid-write updates again from n-1; within the run a lost write is recomputed from its
lineage, :mod:`ppoflow.tasks.checkpoints`); so does the commit of a run's last iteration
(``final``). Any other snapshot is *deferred*: its receipt records the update for replay as well
(``replay[role]["snapshot"]``), commit n publishes without waiting, and a later commit starts the
role's replay chain at the snapshot once it is complete. Until then — and for good, if the write
is lost — the state is rebuilt from the snapshot before it, as between snapshots.

Metrics: ``timing_s/save_checkpoint_<role>`` is what the checkpoint cost this task (staging, plus
waiting for the group's previous write if it was still running: ``timing_s/checkpoint_wait_<role>``),
i.e. the checkpoint time on the iteration's critical path.
"""

from __future__ import annotations

from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.infra.remote.contracts import trained_role, update_of
from ppoflow.tasks.checkpoints import Lineage
from ppoflow.tasks.receipts import AdvantageReceipt, Receipt
from ppoflow.tasks.replay import update_blocks
from ppoflow.tasks.step import Step, Timer, ppo_task

__all__ = ["update_actor", "update_critic"]


def _update(
    step: Step[Receipt], advantage: AdvantageReceipt, previous: str, snapshot: bool, final: bool
) -> Receipt:
    """Run the step's method (the worker's method of the step's name) on the group of its row's
    role from checkpoint ``previous`` and save checkpoint n."""
    role, method = step.spec.role, step.task
    assert role is not None  # the update rows name their group
    ctx, checkpoint = step.ctx, step.paths.checkpoint(role, step.n)
    background = step.cfg.checkpoint.async_save
    worker = step.worker(trained_role(role), previous)
    ctx.groups.set_state(role, None)  # the live module leaves checkpoint n-1 from here on
    data = advantage.output("advantages")
    metrics = reduce_rank_metrics(update_of(worker, method)(data, dp_blocks=update_blocks(step.cfg, method)))
    every = step.cfg.checkpoint.snapshot_every
    replay = {role: {"previous": previous, "batch": data, "method": method}}
    if step.n % every and not snapshot:  # rebuilt by replay when needed
        ctx.groups.set_state(role, checkpoint)
        return step.receipt(checkpoints={role: checkpoint}, replay=replay, metrics=metrics)
    extra = {"iteration": step.n, "experiment": step.cfg.storage.experiment}
    with Timer() as save:
        per_rank = worker.save_checkpoint(checkpoint, extra=extra, background=background)
    ctx.groups.set_state(role, checkpoint)
    lineage = Lineage(role, checkpoint, previous, method, data, extra)
    ctx.writes.started(lineage, ctx.groups.current_group(role), background=background)
    metrics[f"timing_s/save_checkpoint_{role}"] = save.seconds
    metrics[f"timing_s/checkpoint_wait_{role}"] = max(float(r.get("waited_s", 0.0)) for r in per_rank)
    if every > 1 and not final and background:  # deferred: commit does not wait for this write
        deferred = {role: {**replay[role], "snapshot": "deferred"}}
        return step.receipt(checkpoints={role: checkpoint}, replay=deferred, metrics=metrics)
    return step.receipt(checkpoints={role: checkpoint}, metrics=metrics)


@ppo_task("update_actor")
def update_actor(
    step: Step[Receipt], advantage: AdvantageReceipt, actor: str, snapshot: bool = False, final: bool = False
) -> Receipt:
    """PPO policy update from ``actor`` (checkpoint n-1); saves ``checkpoints/actor/n`` if it is a
    snapshot (every ``snapshot_every``-th iteration, or ``snapshot``: the last of a run). ``final``:
    the run's last iteration (its commit waits for the write)."""
    return _update(step, advantage, actor, snapshot, final)


@ppo_task("update_critic")
def update_critic(
    step: Step[Receipt], advantage: AdvantageReceipt, critic: str, snapshot: bool = False, final: bool = False
) -> Receipt:
    """Value update from ``critic`` (checkpoint n-1); saves ``checkpoints/critic/n`` if a snapshot."""
    return _update(step, advantage, critic, snapshot, final)
