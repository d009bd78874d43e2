"""``publish_policy`` (asynchronous training): the policy after ``update_actor`` n, for the producers.

Saves the actor's weights (weights only, a sharded DCP checkpoint the engines load) to the queue's
``policy/v{n:06d}/`` and moves ``policy/latest.json`` to version n
(:class:`~ppoflow.infra.queue.policy.PolicyVersions`); older versions than the producers may
still load are removed. A run's start publishes the version it starts from the same way (the
base weights for a new experiment), so a producer always finds version ``n - 1 - max_staleness``
or newer before it samples batch n. A version that was complete already (a retried task, a rerun
iteration whose update was reused) is only pointed at.
"""

from __future__ import annotations

from ppoflow.infra import faults
from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions
from ppoflow.tasks.receipts import Receipt
from ppoflow.tasks.step import Step, Timer, ppo_task

__all__ = ["publish_policy"]


@ppo_task("publish_policy", roles=("actor",))
def publish_policy(step: Step[Receipt], update: Receipt | str) -> Receipt:
    """Publish policy version ``n``: ``update`` is iteration n's ``update_actor`` receipt, or (at a
    run's start) the URL of the actor's state n."""
    queue = QueuePaths(step.paths.root)
    state = update if isinstance(update, str) else update.checkpoint("actor")
    url = queue.policy(step.n)
    metrics: dict[str, float] = {}
    if not is_complete(url):
        worker = step.worker("actor", state)
        with Timer() as save:
            worker.save_checkpoint(
                url, extra={"iteration": step.n, "policy_version": step.n}, weights_only=True
            )
        metrics["async/publish_s"] = save.seconds
    faults.maybe_kill("publish", step.n)  # drill: the weights are there, the pointer not yet
    versions = PolicyVersions(queue)
    versions.publish(step.n)
    removed = versions.retain()
    if removed:
        step.logger.info(f"policy versions removed (newer ones published): {removed}")
    return step.receipt(outputs={"policy": url}, metrics=metrics)
