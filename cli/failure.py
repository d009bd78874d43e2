"""What the terminal of a ``ppoflow run`` / ``ppoflow demo`` shows when the run fails or is stopped.

One block, no traceback (``--verbose`` adds it), then the command exits non-zero::

    ppoflow: the run failed in task generate-1 (1 attempt, not retried: a retry cannot fix this)
      cause  DataError: runs/x/train.parquet: missing column(s) ['prompt'] ...
      state  iteration 3 is the last committed (this run committed none); the experiment lock and
             this run's device slots are free
      log    prefect flow-run logs 6c1f...   (every task's log, the ranks' output included)
      next   fix the file or field named above, then run: ppoflow run x.yaml --iterations 2

The cause is the flow's error, or, when that only says that a task never ran (Prefect's
``UnfinishedRun``: the task waited on the output of a task that failed), the failed task's error
as the Prefect API recorded it.

:func:`terminal` keeps Prefect's own console output to warnings, without the engine's failure
reports (this block replaces them) and the event and log workers' shutdown notes.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ppoflow.flows.asynchronous import memory_advice
from ppoflow.infra.checkpoint.sharded import CheckpointError
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.lock import ExperimentLocked, LeaseExpired
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.preflight import rollback_hint
from ppoflow.infra.remote.errors import RankFailure
from ppoflow.tasks.step import cause_text, is_permanent, storage_full

__all__ = [
    "print_failure",
    "print_interrupted",
    "committed",
    "cause_text",
    "terminal",
    "TerminalFilter",
]


@dataclass(frozen=True)
class FailedTask:
    """The flow run's failed task as the Prefect API recorded it."""

    name: str
    attempts: int
    message: str  # its final state's message: "Task run encountered an exception OSError: ..."


def _failed_task(flow_run_id: str | None) -> FailedTask | None:
    """The flow run's failed task (the last to fail), from the Prefect API; None if none."""
    if not flow_run_id:
        return None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
    except Exception:  # noqa: BLE001 - the block is printed without it
        return None
    failed = [r for r in runs if r.state is not None and r.state.is_failed()]
    if not failed:
        return None
    never = datetime.datetime.min.replace(tzinfo=datetime.UTC)  # a run with no time at all
    last = max(failed, key=lambda r: r.end_time or r.start_time or r.expected_start_time or never)
    message = (last.state.message if last.state is not None else None) or ""
    return FailedTask(last.name, int(last.run_count or 1), message)


class TaskFailure(Exception):
    """A failed task's error as its recorded state tells it (type name and message): the cause
    shown when the flow's own error only says that a task which waited on it never ran."""

    def __init__(self, task: FailedTask):
        text = task.message.removeprefix(_PREFECT_PREFIX).strip()
        self.kind, _, message = text.partition(": ")
        super().__init__(message or text)
        self.task = task


_PREFECT_PREFIX = "Task run encountered an exception"


def _stands_for_a_failed_task(exc: BaseException | None) -> bool:
    """True when ``exc`` names no cause of its own: Prefect's ``UnfinishedRun`` (a task whose
    input was a failed task's output never ran, and its result was asked for)."""
    from prefect.exceptions import UnfinishedRun

    return exc is None or isinstance(exc, UnfinishedRun)


def _cause(exc: BaseException | None) -> str:
    text = cause_text(exc)
    if isinstance(exc, TaskFailure) and exc.kind:
        text = exc.kind + text.removeprefix(type(exc).__name__)
    return text


def committed(cfg: ExperimentConfig) -> int | None:
    """The experiment's last committed iteration; -1 when it has none yet; None if unreadable."""
    try:
        manifest = read_manifest(ExperimentPaths.of(cfg))
    except Exception:  # noqa: BLE001 - an unreadable manifest is reported elsewhere
        return None
    return manifest.iteration if manifest is not None else -1


def _state_line(cfg: ExperimentConfig, n: int | None, before: int | None) -> str | None:
    """Where the experiment stands, and whether this run's lock is gone (checked, not assumed)."""
    if n is None:
        return None
    paths = ExperimentPaths.of(cfg)
    if n < 0:
        state = "the experiment has no committed iteration yet"
    else:
        state = f"iteration {n} is the last committed"
        if before is not None:
            made = n - max(before, 0)
            state += f" (this run committed {made if made > 0 else 'none'})"
    try:
        locked = storage.exists(paths.lock)
    except Exception:  # noqa: BLE001 - say nothing rather than guess
        return state
    return state + (
        f"; the experiment lock {paths.lock} is still there (another run's?)"
        if locked
        else "; the experiment lock and this run's device slots are free"
    )


def _next_step(exc: BaseException | None, cfg: ExperimentConfig, n: int, rerun: str, permanent: bool) -> str:
    """What to do about ``exc`` (``permanent``: a retry cannot fix it): free the storage, wait for
    the lock's owner, go back to a good checkpoint, fix the input (a deterministic error), or just
    run again (anything a retry may fix)."""
    if storage_full(exc):
        return (
            f"free space where the experiment is stored ({ExperimentPaths.of(cfg).root}: the "
            "filesystem is full or over its quota; `ppoflow status` lists the checkpoints kept, "
            f"checkpoint.keep_last keeps fewer), then run: {rerun}\n"
            "         it resumes at the first unfinished task; nothing half-written was published"
        )
    if isinstance(exc, LeaseExpired):
        return (
            f"make the storage writable again (the cause names the error), then run: {rerun}\n"
            "         it resumes from the last commit"
        )
    if isinstance(exc, ExperimentLocked):
        return f"wait for the run named above to end (or cancel it), then run: {rerun}"
    if device_out_of_memory(exc):
        return _memory_advice(cfg) + f", then run: {rerun}\n         it resumes at the first unfinished task"
    if exc is None or not permanent:
        return (
            f"run the same command again: {rerun}\n         it resumes at the first unfinished task "
            "(finished tasks' outputs are reused) and commits what an uninterrupted run would"
        )
    if isinstance(exc, CheckpointError) or (isinstance(exc, RankFailure) and exc.raised(CheckpointError)):
        return rollback_hint(ExperimentPaths.of(cfg), n)
    return f"fix what the cause names (a retry cannot), then run: {rerun}"


#: How a rank's exception says the device ran out of memory: PyTorch's own error, and the CUDA
#: error text that vLLM's allocator raises as a plain RuntimeError.
_OOM_TYPES = ("torch.OutOfMemoryError",)
_OOM_TEXTS = ("CUDA out of memory", "CUDA Error: out of memory", "OutOfMemoryError")


def device_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` is (or stands for) a device running out of memory in a rank."""
    if exc is None:
        return False
    if isinstance(exc, RankFailure) and any(t in _OOM_TYPES for t in exc.error_types):
        return True
    return any(text in str(exc) for text in _OOM_TEXTS)


def _memory_advice(cfg: ExperimentConfig) -> str:
    """What makes a run fit its device's memory, with the keys to change (docs/gpus.md#memory)."""
    advice = (
        "the device ran out of memory: give the updates fewer tokens at a time "
        "(actor.ppo_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu; without "
        "use_dynamic_bsz, their ppo_micro_batch_size_per_gpu), turn on "
        "model.enable_gradient_checkpointing, or give the engine less (rollout.kv_cache_gib, "
        "rollout.gpu_memory_utilization); docs/gpus.md#memory"
    )
    return advice + memory_advice(cfg)  # what asynchronous training adds, if it is on


def _log_hint(flow_run_id: str | None) -> str:
    from ppoflow.cli.console import command

    if not flow_run_id:
        return "the Prefect UI (prefect server start) lists the run's tasks and their logs"
    return (
        f"{command('prefect')} flow-run logs {flow_run_id}   "
        "(every task's log, the ranks' output included; or the run's page in the Prefect UI)"
    )


def print_failure(
    cfg: ExperimentConfig,
    run: dict[str, Any],
    *,
    rerun: str,
    verbose: bool = False,
    out: Callable[[str], None] = print,
) -> None:
    """The error block of a failed run (module docstring); ``run`` is ``run_with_progress``'s dict."""
    exc = run.get("exception")
    failed = _failed_task(run.get("flow_run_id"))
    if failed is not None and failed.message and _stands_for_a_failed_task(exc):
        exc = TaskFailure(failed)
    if isinstance(exc, TaskFailure):  # permanent when a task that has retries was not retried
        permanent = exc.task.attempts == 1 and cfg.resources.task_retries > 0
    else:
        permanent = is_permanent(exc)
    where = ""
    if failed is not None:
        attempts = failed.attempts
        retried = "not retried: a retry cannot fix this" if attempts == 1 and permanent else None
        where = f" in task {failed.name} ({attempts} attempt{'s' if attempts != 1 else ''}"
        where += f", {retried})" if retried else ")"
    n = committed(cfg)
    state = _state_line(cfg, n, run.get("committed_before"))
    out("")
    out(f"ppoflow: the run failed{where} after {run.get('wall_s', 0.0):.0f} s")
    out(f"  cause  {_cause(exc)}")
    if state:
        out(f"  state  {state}")
    out(f"  log    {_log_hint(run.get('flow_run_id'))}")
    out(f"  next   {_next_step(exc, cfg, max(n or 0, 0), rerun, permanent)}")
    if verbose and exc is not None:
        out("".join(traceback.format_exception(exc)).rstrip())


def print_interrupted(
    cfg: ExperimentConfig,
    how: str,
    wall_s: float,
    rerun: str,
    before: int | None = None,
    out: Callable[[str], None] = print,
) -> None:
    """What a run stopped by Ctrl-C or SIGTERM says on its way out."""
    state = _state_line(cfg, committed(cfg), before)
    out("")
    out(f"ppoflow: stopped by {how} after {wall_s:.0f} s")
    if state:
        out(f"  state  {state}")
    out(f"  next   to continue: {rerun}   (finished tasks of the interrupted iteration are reused)")


class TerminalFilter(logging.Filter):
    """Prefect console records a run's terminal does not show (module docstring)."""

    ENGINE = ("prefect.flow_runs", "prefect.task_runs")
    WORKERS = ("EventsWorker", "APILogWorker")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name in self.ENGINE and record.levelno >= logging.ERROR:
            return False  # "Task run failed ...", "Finished in state Failed", "Crash detected!"
        if record.name in self.WORKERS and record.levelno < logging.ERROR:
            return False  # "Still processing items: N items remaining..." at exit
        return True


@contextlib.contextmanager
def terminal(verbose: bool) -> Iterator[None]:
    """The terminal of a run, inside the block: unless ``verbose``, Prefect's console handlers
    show warnings only, through :class:`TerminalFilter`. At the end Prefect's log and event
    workers are drained (while its API is still up: otherwise they report "Still processing
    items" at exit) and the handlers restored."""
    import prefect.main  # noqa: F401 - sets up Prefect's logging (once per process)
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = (logging.getLogger(), *(logging.getLogger(n) for n in ("prefect", "uvicorn")))
    handlers = {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}
    saved = {h: h.level for h in handlers}
    quiet = TerminalFilter()
    if not verbose:
        for handler in handlers:
            handler.addFilter(quiet)
            handler.setLevel(max(handler.level, logging.WARNING))
    try:
        yield
    finally:
        _drain_prefect_workers()
        for handler, level in saved.items():
            handler.removeFilter(quiet)
            handler.setLevel(level)


def _drain_prefect_workers(timeout_s: float = 10.0) -> None:
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # best effort: Prefect drains again at exit
            worker.drain_all(timeout=timeout_s)
