"""``consume`` (asynchronous training): iteration n's batch from the rollout queue, in place of
``generate``.

Writes ``iterations/n/prompts.arrow`` (the prompts at the manifest's data cursor, exactly as
``generate`` would), waits for batch n of the queue (``ppoflow.infra.queue.batches``: its record,
``done.json``, published by a producer; the wait is ``async/wait_s``, the trainer's idle time),
checks it — its content hash, its prompts against the ones just written, and that every token was
sampled by a policy version the bound allows (``asynchronous.max_staleness``; a batch that breaks
it is refused, :class:`~ppoflow.infra.queue.staleness.StalenessBoundBroken`) — and copies its bytes
to ``iterations/n/rollout.arrow``. The receipt carries the batch's record, which ``commit`` stores
in manifest n: the batch each committed iteration consumed, by hash, so none is consumed twice or
skipped. The rollout has no ``old_log_probs``: ``old_log_prob`` recomputes them on the actor.

Metrics: ``async/*`` (staleness mean and max over the batch's tokens, tokens per staleness, the
versions, sequences sampled by two versions, the producer's sampling and weight-push seconds,
requeued tokens), the engine's ``rollout/*`` of the batch, ``data/*``.
"""

from __future__ import annotations

import time

import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataCursor, DataError
from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.infra.queue.batches import load_batch, wait_record
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.staleness import check_bound, staleness_metrics
from ppoflow.tasks.receipts import ConsumeReceipt
from ppoflow.tasks.run.inputs import iteration_seed
from ppoflow.tasks.step import Step, ppo_task

__all__ = ["consume"]


def _check_prompts(n: int, batch, prompts, samples: int) -> None:
    """The batch was sampled from the prompts at the trainer's data cursor (DataError otherwise)."""
    want = prompts.batch["input_ids"].long().repeat_interleave(samples, dim=0)
    got = batch.batch["prompts"].long()
    if got.shape != want.shape or not torch.equal(got, want):
        raise DataError(
            f"batch {n} of the rollout queue was sampled from other prompts than the data cursor of "
            f"iteration {n} holds (the training data or its settings changed since it was sampled). "
            f"Delete the queue's batches from {n} on (queue/batches/) so they are sampled again"
        )


@ppo_task("consume", ConsumeReceipt)
def consume(step: Step[ConsumeReceipt], cursor: DataCursor) -> ConsumeReceipt:
    """Take batch ``n`` of the queue as iteration ``n``'s rollout (module docstring).

    Outputs ``prompts``, ``rollout``; metrics ``async/*``, ``rollout/*``, ``data/*``.
    """
    cfg, n, ctx = step.cfg, step.n, step.ctx
    a = cfg.asynchronous
    queue = QueuePaths(step.paths.root)
    seed = iteration_seed(cfg.seed, cfg.rollout.seed, n)
    prompts_url, rollout_url = step.file("prompts.arrow"), step.file("rollout.arrow")
    prompts, next_cursor, truncated = ctx.inputs.write_prompts(
        cursor, {"iteration": n, "seed": seed}, prompts_url
    )
    t0 = time.perf_counter()
    step.logger.info(f"waiting for batch {n} of the rollout queue ({queue.batch_dir(n)})")
    record = wait_record(queue, n, poll_s=a.poll_s, timeout_s=a.wait_timeout_s, check=ctx.check_rollouts)
    wait_s = time.perf_counter() - t0
    batch, url = load_batch(queue, n, record)
    _check_prompts(n, batch, prompts, cfg.rollout.n)
    versions, mask = batch.batch["token_versions"], batch.batch["response_mask"]
    check_bound(versions, mask, n, a.max_staleness)
    storage.write_bytes_atomic(rollout_url, storage.read_bytes(url))
    metrics = reduce_rank_metrics([batch.meta_info.get("metrics") or {}])
    metrics.update(staleness_metrics(versions, mask, n, a.max_staleness))
    metrics["async/wait_s"] = wait_s
    for key in ("sample_s", "push_s", "requeued_tokens", "pushes"):
        if key in record.get("producer_metrics", {}):
            metrics[f"async/{key}"] = float(record["producer_metrics"][key])
    metrics["data/truncated_prompts"] = float(truncated)
    metrics["data/epoch"] = float(cursor["epoch"])
    step.logger.info(
        f"batch {n}: {len(batch)} rows sampled by policy versions {record['versions'][0]}..{record['versions'][1]} "
        f"(staleness max {metrics['async/staleness_max']:.0f}), waited {wait_s:.1f} s"
    )
    kept = {k: record[k] for k in ("xxh3", "bytes", "rows", "versions") if k in record}
    return step.receipt(
        outputs={"prompts": prompts_url, "rollout": rollout_url},
        metrics=metrics,
        next_cursor=next_cursor,
        seed=seed,
        truncated_prompts=truncated,
        batch={"file": queue.ref(url), **kept},
    )
