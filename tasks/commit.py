"""``init`` (iteration 0 of a new experiment) and ``commit`` (publish iteration n).

``init``: save the base weights of the actor (and critic) as ``checkpoints/<role>/000000`` right
after the groups are built, and publish manifest 0 (data cursor at the start, the config's KL
coefficient).

``commit``: wait until iteration n's checkpoints are complete (written in the background while
the next iteration already runs; a lost one is recomputed, see ``RunContext.materialize``) — but
not for a deferred snapshot (tasks/update.py), whose state the manifest's replay chain covers
until a later commit finds it written (``Manifest.settled``) — gather
the receipts of iteration n into ``iterations/n/metrics.json``, then publish manifest n (new
checkpoints, the data cursor after this batch, the KL controller's coefficient; with asynchronous
training the record of the queue's batch it consumed), and finally apply the retention policy
(``checkpoint.keep_last`` / ``keep_every``), and then the run's rollout source tidies what the
commit made obsolete (``RolloutSource.after_commit``). Both check first that this run
still holds the experiment lock. A commit that finds manifest n already published returns it (a
retried commit). The manifest never names a checkpoint that is not complete.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from prefect import task

from ppoflow.infra.checkpoint.marker import is_complete, read_marker
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import (
    Manifest,
    initial_manifest,
    next_manifest,
    publish,
    read_manifest,
)
from ppoflow.infra.experiment.metrics import throughput_metrics
from ppoflow.infra.experiment.retention import apply_retention
from ppoflow.infra.remote.contracts import trained_role
from ppoflow.infra.runtime.faults import maybe_fail
from ppoflow.tasks.graph import critical_path, trained_roles
from ppoflow.tasks.receipts import IterationReceipts, Receipt
from ppoflow.tasks.replay import replay_entry
from ppoflow.tasks.run import get_run
from ppoflow.tasks.step import TASK_OPTIONS, task_logs

__all__ = ["init_experiment", "commit", "iteration_metrics"]


@task(name="init", task_run_name="init", **TASK_OPTIONS)
def init_experiment(run: str) -> Manifest:
    """Create iteration 0 of the run's experiment (a no-op returning it if it exists)."""
    ctx = get_run(run)
    cfg, paths = ctx.cfg, ctx.paths
    existing = read_manifest(paths)
    if existing is not None:
        return existing
    maybe_fail("init", "before")
    roles = trained_roles(cfg)
    checkpoints: dict[str, str | None] = {"actor": None, "critic": None}
    with task_logs(ctx, *roles) as logger:
        logger.info(
            f"initialising experiment {cfg.storage.experiment!r} at {paths.root} from {cfg.model.path}"
        )
        for role in roles:
            url = checkpoints[role] = paths.checkpoint(role, 0)
            if is_complete(url):
                continue  # saved by an earlier attempt; a group that needs it loads it
            worker = ctx.groups.worker(trained_role(role), None, progress=logger.info)
            # weights and the fresh optimizer's settings only: it has no state yet
            worker.save_checkpoint(url, extra={"iteration": 0, "experiment": cfg.storage.experiment})
            ctx.groups.set_state(role, url)
    assert checkpoints["actor"] is not None  # "actor" is always in roles
    manifest = initial_manifest(
        cfg, paths, checkpoints["actor"], checkpoints["critic"], kl_coef=cfg.algorithm.kl_ctrl.kl_coef
    )
    ctx.check_lock()
    publish(paths, manifest)
    maybe_fail("init", "after")
    return manifest


def iteration_metrics(receipts: list[Receipt], wall_s: float, nprocs: int) -> dict[str, float]:
    """One flat dict for ``metrics.json``: every task's metrics, ``timing_s/<task>``, the
    iteration's wall time, its critical path, the orchestration overhead, and throughput."""
    metrics: dict[str, float] = {}
    for receipt in sorted(receipts, key=lambda r: r.task):
        metrics.update(receipt.metrics)
        metrics[f"timing_s/{receipt.task}"] = float(receipt.timing_s)
    critical = sum(
        max((metrics.get(f"timing_s/{t}", 0.0) for t in stage), default=0.0) for stage in critical_path()
    )
    metrics["timing_s/iteration"] = wall_s
    metrics["timing_s/critical_path"] = critical
    metrics["timing_s/overhead"] = max(0.0, wall_s - critical)
    metrics.update(throughput_metrics(metrics.get("perf/total_num_tokens", 0.0), wall_s, nprocs))
    return metrics


def _settle_checkpoints(ctx, receipts: IterationReceipts, logger) -> dict[str, float]:
    """Wait for (or recover, concurrently per role) the iteration's checkpoints; their write metrics."""
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    updates = {role: receipts.update_of(role) for role in trained_roles(ctx.cfg)}
    wanted = {r: u.checkpoints[r] for r, u in updates.items() if u is not None and r not in u.replay}
    with ThreadPoolExecutor(max_workers=len(wanted) or 1, thread_name_prefix="ppoflow-commit") as pool:
        jobs = [pool.submit(ctx.groups.materialize, role, url, logger.info) for role, url in wanted.items()]
        for job in jobs:
            job.result()
    for role, url in wanted.items():
        marker = read_marker(url)
        if "write_s" in marker:
            metrics[f"timing_s/checkpoint_write_{role}"] = float(marker["write_s"])
        if "bytes" in marker:
            metrics[f"perf/checkpoint_bytes_{role}"] = float(marker["bytes"])
    metrics["timing_s/commit_wait_checkpoints"] = time.perf_counter() - t0
    return metrics


def _updated(cfg, paths, receipts: IterationReceipts) -> dict[str, dict | None]:
    """The roles iteration n updated: None where the state was written, else the update's record
    for the manifest's replay chain (the batch hashed now, once)."""
    out: dict[str, dict | None] = {}
    for role in trained_roles(cfg):
        update = receipts.update_of(role)
        if update is not None:
            out[role] = replay_entry(paths, update, role) if role in update.replay else None
    return out


def _evaluation_of_zero(paths) -> dict[str, float] | None:
    """The metrics of iteration 0's evaluation (``evaluation.before_training``), if it ran."""
    url = paths.receipt(0, "evaluate")
    return Receipt.model_validate(storage.read_json(url)).metrics if storage.exists(url) else None


@task(name="commit", task_run_name="commit-{n}", **TASK_OPTIONS)
def commit(
    run: str,
    n: int,
    previous: Manifest,
    receipts: IterationReceipts,
    started: float,
    rollout_checkpoints: dict[str, str | None] | None = None,
    evaluation: Receipt | None = None,
) -> Manifest:
    """Publish manifest ``n`` on top of ``previous`` (manifest n-1) from the iteration's receipts.

    ``started``: ``time.time()`` when the flow began the iteration (for ``timing_s/iteration``).
    ``rollout_checkpoints``: what iteration n+1's rollout and values use when they are not the
    new checkpoints (``algorithm.overlap: one_step``); kept by retention as long as manifest n is.
    ``evaluation``: the ``evaluate`` receipt of iteration n when it was evaluated (its ``val/*``
    metrics join ``metrics.json``). Commit 1 also adds iteration 0's evaluation to the trend.
    """
    ctx = get_run(run)
    cfg, paths = ctx.cfg, ctx.paths
    current = read_manifest(paths)
    if current is not None and current.iteration == n:
        return current
    maybe_fail("commit", "before", n)
    with task_logs(ctx) as logger:
        t0 = time.time()
        written = _settle_checkpoints(ctx, receipts, logger)
        # the wait for the background checkpoint writes is the commit's time on the critical path
        commit_time = Receipt(task="commit", iteration=n, timing_s=time.time() - t0)
        extra = [evaluation] if evaluation is not None else []
        metrics = iteration_metrics(
            [*receipts.all(), *extra, commit_time], wall_s=time.time() - started, nprocs=cfg.resources.nprocs
        )
        metrics.update(written)
        metrics.update({"iteration": n, "time/started_unix_s": started, "time/committed_unix_s": time.time()})
        storage.write_json_atomic(paths.file(n, "metrics.json"), metrics)
        manifest = _manifest(ctx, n, previous, receipts, metrics, rollout_checkpoints)
        ctx.check_lock()
        publish(paths, manifest)
        maybe_fail("commit", "after", n)
        _retain(ctx, n, manifest, logger)
    return manifest


def _manifest(
    ctx, n: int, previous: Manifest, receipts: IterationReceipts, metrics: dict, rollout: dict | None
) -> Manifest:
    """Manifest ``n``: ``previous`` advanced by the iteration's receipts (checkpoints, cursor, KL
    coefficient, metrics), its replay chain settled on what is complete."""
    cfg, paths = ctx.cfg, ctx.paths
    actor_checkpoint = receipts.checkpoint("actor")
    assert actor_checkpoint is not None  # update_actor runs in every iteration
    return next_manifest(
        previous,
        cfg,
        paths,
        actor_checkpoint=actor_checkpoint,
        critic_checkpoint=receipts.checkpoint("critic") or paths.url(previous.critic_checkpoint),
        data_cursor=receipts.generate.next_cursor,
        kl_coef=receipts.advantage.kl_coef,
        metrics=metrics,
        rollout_checkpoints=rollout,
        before=_evaluation_of_zero(paths) if n == 1 else None,
        updated=_updated(cfg, paths, receipts),
        data_files=ctx.inputs.data_files,
        consumed=receipts.consumed,
    ).settled(lambda ref: is_complete(paths.url(ref) or ""))


def _retain(ctx, n: int, manifest: Manifest, logger) -> None:
    """Apply the retention policy after commit ``n``, then let the run's rollout source remove
    what the commit made obsolete (a failure is logged: the next commit retries)."""
    try:
        removed = [ctx.paths.ref(u) for u in apply_retention(ctx.paths, ctx.cfg.checkpoint, manifest)]
        removed += ctx.rollouts.after_commit(n)
    except Exception as exc:  # noqa: BLE001 - the commit stands; the next one retries the cleanup
        logger.warning(f"retention after commit {n} failed (the next commit tries again): {exc}")
    else:
        if removed:
            logger.info(f"retention: removed {', '.join(removed)}")
