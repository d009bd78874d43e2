"""What every ppoflow task shares: task options, the retry rule, and receipts.

A task's *receipt* (``iterations/{n:06d}/tasks/<task>.json``, paths in it relative to the
experiment root) is written after its outputs are
complete and holds ``{task, iteration, outputs: {name: url}, checkpoints: {role: url}, metrics,
timing_s, extra}``. A task
that finds its receipt, and every output it lists still complete (an Arrow file: it exists, as
writes are atomic; a checkpoint: its completion marker), returns the receipt instead of working
again. That is how a retried or rerun flow resumes at the first unfinished task: storage, not
Prefect's result cache, is the record (``cache_policy=NO_CACHE``, so a deleted experiment is never
"resumed" from a stale cache). Receipts are reused even if the config changed in between (say, a
smaller micro-batch after an out-of-memory failure does not redo the rollout); the config that
commits the iteration is the one recorded in its manifest.

Retries: every task retries (``TASK_RETRIES`` times) except on errors that a retry cannot fix
(:data:`PERMANENT_ERRORS`: config, data, lock and manifest errors).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect.cache_policies import NO_CACHE

from ppoflow.infra.config import ConfigError
from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataError
from ppoflow.infra.experiment.lock import ExperimentLocked
from ppoflow.infra.experiment.manifest import ManifestConflict, now_iso
from ppoflow.tasks.runtime import RunContext

__all__ = [
    "TASK_OPTIONS",
    "TASK_RETRIES",
    "PERMANENT_ERRORS",
    "retryable",
    "find_receipt",
    "write_receipt",
    "Timer",
    "output_complete",
]

TASK_RETRIES = 2
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    ExperimentLocked,
    ManifestConflict,
)


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure is a :data:`PERMANENT_ERRORS`."""
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except BaseException:  # noqa: BLE001 - any other failure may pass on a retry
        return True
    return True


TASK_OPTIONS: dict[str, Any] = dict(
    retries=TASK_RETRIES,
    retry_delay_seconds=1,
    retry_condition_fn=retryable,
    cache_policy=NO_CACHE,
    persist_result=False,
)


def output_complete(url: str, checkpoint: bool = False) -> bool:
    """True when the output at ``url`` is complete: a checkpoint with its completion marker, or
    a file that exists (DataProto and JSON writes are atomic)."""
    if checkpoint:
        from ppoflow.infra.checkpoint.sharded import is_complete

        return is_complete(url)
    return storage.exists(url)


def find_receipt(ctx: RunContext, n: int, task: str) -> dict[str, Any] | None:
    """The receipt of ``task`` for iteration ``n`` if it and all its outputs are complete."""
    url = ctx.paths.receipt(n, task)
    if not storage.exists(url):
        return None
    receipt = _resolved(ctx, storage.read_json(url))
    files = [u for u in receipt["outputs"].values() if u]
    ckpts = [u for u in receipt["checkpoints"].values() if u]
    if all(output_complete(u) for u in files) and all(output_complete(u, True) for u in ckpts):
        receipt["resumed"] = True
        return receipt
    return None


def write_receipt(
    ctx: RunContext,
    n: int,
    task: str,
    *,
    outputs: dict[str, str | None],
    checkpoints: dict[str, str | None] | None = None,
    metrics: dict[str, Any] | None = None,
    timing_s: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Record that ``task`` finished iteration ``n`` (call after its outputs are complete)."""
    receipt = {
        "task": task,
        "iteration": n,
        "outputs": {k: ctx.paths.ref(v) for k, v in outputs.items()},
        "checkpoints": {k: ctx.paths.ref(v) for k, v in (checkpoints or {}).items()},
        "metrics": metrics or {},
        "timing_s": timing_s,
        "extra": extra or {},
        "finished_at": now_iso(),
        "resumed": False,
    }
    storage.write_json_atomic(ctx.paths.receipt(n, task), receipt)
    return _resolved(ctx, receipt)


def _resolved(ctx: RunContext, receipt: dict[str, Any]) -> dict[str, Any]:
    """The receipt with its stored (experiment-relative) references turned into URLs."""
    out = dict(receipt)
    for part in ("outputs", "checkpoints"):
        out[part] = {k: ctx.paths.url(v) for k, v in (receipt.get(part) or {}).items()}
    return out


class Timer:
    """Wall-clock seconds of a block: ``with Timer() as t: ...; t.seconds``."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


@contextmanager
def task_logs(ctx: RunContext, *roles: str) -> Iterator[Any]:
    """The task's Prefect logger, with the rank output of ``roles`` routed into it."""
    from prefect import get_run_logger

    logger = get_run_logger()
    with _route(ctx, roles, logger):
        yield logger


@contextmanager
def _route(ctx: RunContext, roles: tuple[str, ...], logger: Any) -> Iterator[None]:
    if not roles:
        yield
        return
    with ctx.using(roles[0], logger), _route(ctx, roles[1:], logger):
        yield
