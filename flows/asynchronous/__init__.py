"""Asynchronous training, the flows' side: a rollout producer fills the experiment's queue ahead
of the trainer, within ``asynchronous.max_staleness`` (docs/async.md).

    rollouts = rollout_source(cfg, iterations, logger.info)     # the ppo flow: the queue, or generate
    with ExperimentSession(cfg, logger, key, rollouts=rollouts) as session: ...

source.py    the trainer's side: the queue as the run's RolloutSource (reconcile, the producer's
             start and stop, retention after a commit), and the one place that picks a source
producer.py  the producer the trainer starts: the ppo-rollout flow in a process of its own, watched
rollout.py   the ``ppo-rollout`` flow: which batch next (its admission), one ``produce`` task each
produce.py   the ``produce`` task: one batch sampled by the producer's group and published
chunks.py    a batch sampled in chunks, so that a newer policy reaches the engine in between

The queue on storage (layout, policy versions, batches, leases, staleness, admission) is
``ppoflow.infra.queue``; the trainer's two steps, ``consume`` and ``publish_policy``, are rows of
the iteration's table (``ppoflow.tasks.graph``). The package's ``__init__`` loads the trainer's
side only: ``python -m ppoflow.flows.asynchronous.rollout`` runs the producer.
"""

from ppoflow.flows.asynchronous.source import QueueSource, memory_advice, rollout_source

__all__ = ["QueueSource", "rollout_source", "memory_advice"]
