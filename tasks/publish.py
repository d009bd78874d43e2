"""``publish_policy`` (asynchronous training): the policy after ``update_actor`` n, for the producers.

Saves the actor's weights (weights only, a sharded DCP checkpoint the engines load) to the queue's
``policy/v{n:06d}/`` and moves ``policy/latest.json`` to version n
(:class:`~ppoflow.infra.queue.policy.PolicyVersions`); older versions than the producers may
still load are removed. A run's start publishes the version it starts from the same way (the
base weights for a new experiment), so a producer always finds version ``n - 1 - max_staleness``
or newer before it samples batch n. A version that was complete already (a retried task, a rerun
iteration whose update was reused) is only pointed at.

**In the background** when ``max_staleness`` >= 1: the task returns once the weights are staged in
host memory, and the actor group's checkpoint writer writes them while the trainer goes on (the
write is what used to keep the trainer waiting: seconds at a 0.5B model, against a fraction of a
second to stage). A producer loads a version only once its marker has landed
(:meth:`~ppoflow.infra.queue.policy.PolicyVersions.latest`), so it never sees a half-written one;
the pointer follows at the next publish. Versions are written in the engines' dtype when that
is narrower than the model's (``ExperimentConfig.policy_version_dtype``: bf16 engines, fp32
weights): the weights the engines end up with are the same, at half the bytes. A lost background write (the group died, storage
refused it) costs nothing but that version: with a bound of one or more, version n - 1 still
admits every batch the trainer waits for, and the next publish, finding version n - 1
incomplete, writes synchronously, so a failure that persists fails that task with its own
error. At ``max_staleness: 0`` batch n can only be sampled by version n - 1, which must not be
lost: the write stays synchronous, as it does at a run's start.
"""

from __future__ import annotations

from ppoflow.infra.checkpoint.marker import is_complete, read_failure
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions
from ppoflow.infra.remote.contracts import ACTOR_ROLE, ActorContract
from ppoflow.infra.runtime import faults
from ppoflow.tasks.receipts import Receipt
from ppoflow.tasks.step import Step, Timer, ppo_task

__all__ = ["publish_policy"]


@ppo_task("publish_policy")
def publish_policy(step: Step[Receipt], update_actor: Receipt | str) -> Receipt:
    """Publish policy version ``n``: ``update_actor`` is iteration n's ``update_actor`` receipt, or
    (at a run's start) the URL of the actor's state n."""
    queue = QueuePaths(step.paths.root)
    state = update_actor if isinstance(update_actor, str) else update_actor.checkpoint("actor")
    url = queue.policy(step.n)
    metrics: dict[str, float] = {}
    if not is_complete(url):
        worker = step.worker(ACTOR_ROLE, state)
        background = not isinstance(update_actor, str) and _previous_is_complete(step, queue, worker)
        with Timer() as save:
            worker.save_checkpoint(
                url,
                extra={"iteration": step.n, "policy_version": step.n},
                weights_only=True,
                background=background,
                dtype=step.cfg.policy_version_dtype,
            )
        metrics["async/publish_s"] = save.seconds
        metrics["async/publish_background"] = float(background)
    faults.maybe_kill("publish", step.n)  # drill: the weights are there, the pointer not yet
    versions = PolicyVersions(queue)
    versions.settle()  # the pointer to the newest complete version: n, unless it is still being written
    removed = versions.retain()
    if removed:
        step.logger.info(f"policy versions removed (newer ones published): {removed}")
    return step.receipt(outputs={"policy": url}, metrics=metrics)


def _previous_is_complete(step: Step[Receipt], queue: QueuePaths, worker: ActorContract) -> bool:
    """Whether version n may be written in the background (module docstring): a bound of one or
    more, and version n - 1 complete once the group's previous background write is over (a failed
    one is logged, and this version is then written synchronously)."""
    if step.cfg.asynchronous.max_staleness < 1:
        return False
    worker.wait_checkpoint()  # its outcome is on storage: the marker, or a failure record
    previous = queue.policy(step.n - 1)
    if is_complete(previous):
        return True
    failure = read_failure(previous)
    step.logger.warning(
        f"policy version {step.n - 1} was not published ({failure or 'its background write did not finish'}); "
        f"version {step.n} is written before the task returns"
    )
    return False
