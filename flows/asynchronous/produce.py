"""``produce``: one batch of the rollout queue, sampled by the producer's group (the ``ppo-rollout``
flow runs one such task per batch; docs/async.md).

Batch k's prompts are the ones iteration k takes (the data cursor's batch; its seed the
iteration's, :func:`~ppoflow.tasks.run.inputs.iteration_seed`), written to the batch's directory.
The task holds the batch's lease (:func:`~ppoflow.infra.queue.batches.claim_batch`) while it
works: it loads the newest published policy version into the engine if the group holds another
(``load_policy``; the push on the next rollout is the only pause), samples the rows no published
part holds yet, publishes them as parts (each row with its index and the version of each token,
``token_versions``), and when every row is there the whole batch and its record. A retry, or a
producer that takes over a dead one's lease, samples only what no part holds.

With ``asynchronous.max_staleness: 0`` (or when no newer version can come: the producer is never
more than the bound ahead) the rows are sampled in one call exactly as ``generate`` samples them
(same rows per rank, same per-request seeds): the batch equals the synchronous rollout bit for
bit on CPU. Otherwise generation runs in chunks of ``asynchronous.chunk_tokens``
(:mod:`ppoflow.flows.asynchronous.chunks`), and a version published in between reaches the engine between two
chunks.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from prefect import task

from ppoflow.flows.asynchronous.chunks import sample_in_chunks
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.queue.batches import (
    ROW,
    claim_batch,
    finished_rows,
    publish_batch,
    publish_part,
    read_record,
)
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions, Published
from ppoflow.infra.queue.staleness import tag_versions
from ppoflow.infra.remote.contracts import ACTOR_ROLE
from ppoflow.infra.runtime import faults
from ppoflow.tasks.run import RunContext, get_run
from ppoflow.tasks.run.inputs import iteration_seed
from ppoflow.tasks.step import TASK_OPTIONS, task_logs

__all__ = ["produce", "ProducerGroup"]


class ProducerGroup:
    """The producer's worker group as a batch's sampling sees it: which policy version the engine
    holds, loading the newest, sampling a prompt file (seconds and pushes tallied)."""

    def __init__(self, ctx: RunContext, logger: Any):
        self.ctx, self.logger = ctx, logger
        self.versions = PolicyVersions(QueuePaths(ctx.paths.root))
        self.sample_s = self.push_s = 0.0
        self.pushes = 0

    @property
    def version(self) -> int | None:
        """The version the engine samples from next (None: not loaded in this group yet)."""
        state = self.ctx.groups.state("actor")
        return None if state is None else int(state.rsplit("/v", 1)[1])

    def load(self, policy: Published, k: int) -> bool:
        """Make ``policy`` the engine's weights for the next call (sampling batch ``k``); True if
        that changed them."""
        if self.ctx.groups.state("actor") == policy.url:
            return False
        worker = self.ctx.groups.worker(ACTOR_ROLE, None, progress=self.logger.info)
        worker.load_policy(policy.url)
        faults.maybe_kill("policy_load", k)  # drill: the producer dies while it loads a version
        self.ctx.groups.set_state("actor", policy.url)
        self.logger.info(f"policy version {policy.version} loaded ({policy.url})")
        return True

    def newest(self, k: int) -> bool:
        """Load the newest published version if it is newer than the engine's; True if so."""
        latest = self.versions.latest()
        return latest is not None and latest.version != self.version and self.load(latest, k)

    def sample(self, prompts_url: str, out_url: str) -> DataProto:
        """The engine's rollout of the prompts at ``prompts_url`` (their ``meta_info`` says how)."""
        worker = self.ctx.groups.worker(ACTOR_ROLE, None, progress=self.logger.info)
        t0 = time.perf_counter()
        worker.generate_responses(prompts_url, out_url=out_url)
        self.sample_s += time.perf_counter() - t0
        out = DataProto.load(out_url)
        storage.rm(out_url)
        push = float((out.meta_info.get("metrics") or {}).get("rollout/weight_sync_s", 0.0))
        self.push_s += push
        self.pushes += int(push > 0)
        return out


def _one_call(group: ProducerGroup, queue: QueuePaths, k: int, prompts: DataProto, url: str) -> None:
    """Sample every row of batch ``k`` in one call (the synchronous rollout's) and publish them."""
    version = group.version
    assert version is not None  # loaded before sampling
    out = group.sample(url, storage.join_inside(queue.batch_dir(k), "sampled.arrow"))
    out.batch["token_versions"] = tag_versions(out.batch["response_mask"], version)
    out.batch[ROW] = torch.arange(len(out), dtype=torch.long)
    publish_part(queue, k, out)


def _record(rows: DataProto, group: ProducerGroup, cursor: DataCursor, requeued: int) -> dict[str, Any]:
    versions = rows.batch["token_versions"][rows.batch["response_mask"].bool()]
    span = [int(versions.min()), int(versions.max())] if versions.numel() else [group.version, group.version]
    return {
        "versions": span,
        "cursor": dict(cursor),
        "producer_metrics": {
            "sample_s": group.sample_s,
            "push_s": group.push_s,
            "pushes": group.pushes,
            "requeued_tokens": requeued,
        },
        "producer": {"run": group.ctx.key},
    }


def _sample_batch(ctx: RunContext, logger: Any, k: int, cursor: DataCursor, claim: Any) -> dict[str, Any]:
    """Sample what batch ``k`` still lacks and publish it (the lease checked before each write)."""
    cfg, queue = ctx.cfg, QueuePaths(ctx.paths.root)
    a = cfg.asynchronous
    group = ProducerGroup(ctx, logger)
    latest = group.versions.latest()
    if latest is None or latest.version < a.first_version(k):
        raise RuntimeError(f"batch {k} needs policy version >= {a.first_version(k)}; the newest is {latest}")
    group.load(latest, k)
    prompts_url = storage.join_inside(queue.batch_dir(k), "prompts.arrow")
    seed = iteration_seed(cfg.seed, cfg.rollout.seed, k)
    prompts, _, _ = ctx.inputs.write_prompts(cursor, {"iteration": k, "seed": seed}, prompts_url)
    done = finished_rows(queue, k)
    requeued = 0
    if done is None:
        claim.check()
        if group.version == k - 1 or a.max_staleness == 0:  # no newer version can come: one call
            _one_call(group, queue, k, prompts, prompts_url)
        else:
            requeued = sample_in_chunks(group, queue, k, prompts, set(), claim.check)
    elif len(done) < len(prompts) * cfg.rollout.n:
        have = set(done.batch[ROW].tolist())
        logger.info(f"batch {k}: {len(have)} rows were published by an earlier attempt; sampling the rest")
        requeued = sample_in_chunks(group, queue, k, prompts, have, claim.check)
    rows = finished_rows(queue, k)
    assert rows is not None
    claim.check()
    record = publish_batch(queue, k, rows, _record(rows, group, cursor, requeued))
    storage.rm(prompts_url)
    return record


@task(name="produce", task_run_name="produce-{k}", **TASK_OPTIONS)
def produce(run: str, k: int, cursor: DataCursor) -> dict[str, Any] | None:
    """Sample batch ``k`` of the queue from the prompts at ``cursor`` (module docstring); its record
    (the existing one when the batch is complete already; None when another live producer holds
    its lease)."""
    ctx = get_run(run)
    queue = QueuePaths(ctx.paths.root)
    existing = read_record(queue, k)
    if existing is not None:
        return existing
    with task_logs(ctx, "actor") as logger, ctx.groups.hold("actor"):
        claim = claim_batch(queue, k, run, ctx.cfg.asynchronous.lease_stale_after_s, log=logger.warning)
        if claim is None:
            logger.info(f"batch {k} is being sampled by another producer")
            return None
        try:
            return _sample_batch(ctx, logger, k, cursor, claim)
        finally:
            claim.release()
