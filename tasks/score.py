"""The three independent reads of a rollout: ``ref_log_prob``, ``values``, ``rm_score``.

Each runs one DP_COMPUTE_PROTO method on its worker group and writes one DataProto with the new
column(s) only, under ``iterations/{n:06d}/``:

    ref_log_prob   actor group   compute_ref_log_prob -> ref_log_prob.arrow  ("ref_log_prob")
    values         critic group  compute_values       -> values.arrow        ("values")
    rm_score       reward group  compute_rm_score     -> rm_scores.arrow     ("rm_scores")

The flow submits them together; they run on different groups, so concurrently.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from ppoflow.infra.runtime.faults import maybe_fail
from ppoflow.tasks.common import TASK_OPTIONS, Timer, find_receipt, task_logs, write_receipt
from ppoflow.tasks.runtime import get_run

__all__ = ["ref_log_prob", "values", "rm_score"]


def _score(
    run: str, n: int, name: str, role: str, method: str, filename: str, rollout_url: str, state: str | None
) -> dict[str, Any]:
    ctx = get_run(run)
    done = find_receipt(ctx, n, name)
    if done is not None:
        return done
    maybe_fail(name, "before")
    out_url = ctx.paths.file(n, filename)
    with task_logs(ctx, role) as logger, Timer() as timer:
        ctx.group(role, state, progress=logger.info)
        ctx.call(role, method, rollout_url, out_url=out_url)
    receipt = write_receipt(ctx, n, name, outputs={name: out_url}, timing_s=timer.seconds)
    maybe_fail(name, "after")
    return receipt


@task(name="ref_log_prob", task_run_name="ref_log_prob-{n}", **TASK_OPTIONS)
def ref_log_prob(run: str, n: int, generated: dict[str, Any]) -> dict[str, Any]:
    """Log-probs of the sampled responses under the frozen reference policy."""
    return _score(
        run,
        n,
        "ref_log_prob",
        "actor",
        "compute_ref_log_prob",
        "ref_log_prob.arrow",
        generated["outputs"]["rollout"],
        state=None,
    )


@task(name="values", task_run_name="values-{n}", **TASK_OPTIONS)
def values(run: str, n: int, generated: dict[str, Any], critic_checkpoint: str) -> dict[str, Any]:
    """The critic's values of the rollout, with the critic of ``critic_checkpoint`` (n-1)."""
    return _score(
        run,
        n,
        "values",
        "critic",
        "compute_values",
        "values.arrow",
        generated["outputs"]["rollout"],
        state=critic_checkpoint,
    )


@task(name="rm_score", task_run_name="rm_score-{n}", **TASK_OPTIONS)
def rm_score(run: str, n: int, generated: dict[str, Any]) -> dict[str, Any]:
    """The reward model's score of each response (on its last token)."""
    return _score(
        run,
        n,
        "rm_score",
        "reward_model",
        "compute_rm_score",
        "rm_scores.arrow",
        generated["outputs"]["rollout"],
        state=None,
    )
