"""``init`` (iteration 0 of a new experiment) and ``commit`` (publish iteration n).

``init``: save the base weights of the actor (and critic) as ``checkpoints/<role>/000000`` right
after the groups are built, and publish manifest 0 (data cursor at the start, the config's KL
coefficient).

``commit``: gather the receipts of iteration n into ``iterations/n/metrics.json``, then publish
manifest n (new checkpoints, the data cursor after this batch, the KL controller's coefficient).
Both check first that this run still holds the experiment lock. A commit that finds manifest n
already published returns it (a retried commit).
"""

from __future__ import annotations

import time
from typing import Any

from prefect import task

from ppoflow.infra.checkpoint.sharded import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import (
    Manifest,
    initial_manifest,
    next_manifest,
    publish,
    read_manifest,
)
from ppoflow.infra.experiment.metrics import throughput_metrics
from ppoflow.infra.runtime.faults import maybe_fail
from ppoflow.tasks.common import TASK_OPTIONS, task_logs
from ppoflow.tasks.runtime import get_run

__all__ = ["init_experiment", "commit", "iteration_metrics"]

#: Tasks on the iteration's critical path; parallel ones are grouped (the slowest counts).
CRITICAL_PATH = (
    ("generate",),
    ("ref_log_prob", "values", "rm_score"),
    ("advantage",),
    ("update_actor", "update_critic"),
    ("commit",),
)


@task(name="init", task_run_name="init", **TASK_OPTIONS)
def init_experiment(run: str) -> dict[str, Any]:
    """Create iteration 0 of the run's experiment (a no-op returning it if it exists)."""
    ctx = get_run(run)
    cfg, paths = ctx.cfg, ctx.paths
    existing = read_manifest(paths)
    if existing is not None:
        return existing.to_json()
    maybe_fail("init", "before")
    roles = ["actor"] + (["critic"] if cfg.critic.enable else [])
    checkpoints: dict[str, str | None] = {"actor": None, "critic": None}
    with task_logs(ctx, *roles) as logger:
        logger.info(
            f"initialising experiment {cfg.storage.experiment!r} at {paths.root} from {cfg.model.path}"
        )
        for role in roles:
            url = checkpoints[role] = paths.checkpoint(role, 0)
            if is_complete(url):
                continue  # saved by an earlier attempt; a group that needs it loads it
            ctx.group(role, None, progress=logger.info)
            ctx.call(
                role, "save_checkpoint", url, extra={"iteration": 0, "experiment": cfg.storage.experiment}
            )
            ctx.set_state(role, url)
    manifest = initial_manifest(
        cfg, paths, checkpoints["actor"], checkpoints["critic"], kl_coef=cfg.algorithm.kl_ctrl.kl_coef
    )
    ctx.lock.check()
    publish(paths, manifest)
    maybe_fail("init", "after")
    return manifest.to_json()


def iteration_metrics(receipts: dict[str, dict[str, Any]], wall_s: float, nprocs: int) -> dict[str, float]:
    """One flat dict for ``metrics.json``: every task's metrics, ``timing_s/<task>``, the
    iteration's wall time, its critical path, the orchestration overhead, and throughput."""
    metrics: dict[str, float] = {}
    for name, receipt in sorted(receipts.items()):
        metrics.update(receipt.get("metrics") or {})
        metrics[f"timing_s/{name}"] = float(receipt.get("timing_s") or 0.0)
    critical = sum(
        max((metrics.get(f"timing_s/{t}", 0.0) for t in stage), default=0.0) for stage in CRITICAL_PATH
    )
    metrics["timing_s/iteration"] = wall_s
    metrics["timing_s/critical_path"] = critical
    metrics["timing_s/overhead"] = max(0.0, wall_s - critical)
    metrics.update(throughput_metrics(metrics.get("perf/total_num_tokens", 0.0), wall_s, nprocs))
    return metrics


@task(name="commit", task_run_name="commit-{n}", **TASK_OPTIONS)
def commit(
    run: str, n: int, previous: dict[str, Any], receipts: dict[str, dict[str, Any]], started: float
) -> dict[str, Any]:
    """Publish manifest ``n`` on top of ``previous`` (manifest n-1) from the iteration's receipts.

    ``started``: ``time.time()`` when the flow began the iteration (for ``timing_s/iteration``).
    """
    ctx = get_run(run)
    cfg, paths = ctx.cfg, ctx.paths
    current = read_manifest(paths)
    if current is not None and current.iteration == n:
        return current.to_json()
    maybe_fail("commit", "before")
    t0 = time.time()
    prev = Manifest.from_json(previous)
    critic_ckpt = (
        receipts["update_critic"]["checkpoints"]["critic"]
        if "update_critic" in receipts
        else paths.url(prev.critic_checkpoint)
    )
    metrics = iteration_metrics(
        {**receipts, "commit": {"timing_s": time.time() - t0}},
        wall_s=time.time() - started,
        nprocs=cfg.resources.nprocs,
    )
    metrics["iteration"] = n
    metrics_url = paths.file(n, "metrics.json")
    storage.write_json_atomic(metrics_url, metrics)
    manifest = next_manifest(
        prev,
        cfg,
        paths,
        actor_checkpoint=receipts["update_actor"]["checkpoints"]["actor"],
        critic_checkpoint=critic_ckpt,
        data_cursor=receipts["generate"]["extra"]["next_cursor"],
        kl_coef=receipts["advantage"]["extra"]["kl_coef"],
        metrics=metrics,
    )
    ctx.lock.check()
    publish(paths, manifest)
    maybe_fail("commit", "after")
    return manifest.to_json()
