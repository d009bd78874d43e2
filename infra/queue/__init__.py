"""The rollout queue of asynchronous training: what a producer and the trainer share, on storage.

layout.py     where everything lives under ``<experiment>/queue/`` (:class:`QueuePaths`)
policy.py     the published policy versions and the pointer to the newest (``policy/latest.json``)
batches.py    a batch's lease, its parts, the complete batch and its record (``done.json``)
staleness.py  the versions that sampled each token, their statistics, and the bound
admission.py  which batches a producer may start now (Admission; the default keeps the bound)
inflight.py   the rows of a batch sampled in chunks: contexts, versions, requeues
control.py    the stop marker, the queue made to agree with the manifest, retention, its status

Nothing here imports Prefect or the layers above; the flows and tasks build on it: the
trainer's and the producer's sides are ``ppoflow.flows.asynchronous``, the trainer's two steps
``consume`` and ``publish_policy`` rows of the iteration's table (docs/async.md, docs/internals.md
"The rollout queue").
"""
