"""The skeleton every step of an iteration shares, in one decorator: :func:`ppo_task`.

    @ppo_task("values")            # the row STEP["values"]: role critic, reads generate, ...
    def values(step: Step, generate: GenerateReceipt, rollout_critic: str) -> Receipt:
        out = step.file("values.arrow")
        step.worker(CRITIC_ROLE, rollout_critic).compute_values(generate.output("rollout"), out_url=out)
        return step.receipt(outputs={step.output_key: out})

becomes the Prefect task ``values(run: str, n: int, generate, rollout_critic) -> Receipt``. At
decoration (the module's import) the body's parameters after ``step`` must be the row's inputs by
name and in order (:meth:`~ppoflow.tasks.graph.StepSpec.check_parameters`: a
:class:`~ppoflow.tasks.graph.WiringError` otherwise); the task

1. looks up the flow run's :class:`~ppoflow.tasks.run.RunContext` by ``run``;
2. returns the stored receipt if iteration ``n`` of this task already finished with the same
   inputs (resume; see :mod:`ppoflow.tasks.receipts`);
3. fires ``PPOFLOW_FAULT`` drills before and after the work (``ppoflow.infra.runtime.faults``);
4. routes the rank output of its row's role into the task's log, and times the body;
5. holds each group the body uses (``step.worker``: the row's role unless named) until the body ends;
6. writes the receipt (with the body's wall time and inputs) once the outputs are complete.

Every task retries :data:`TASK_RETRIES` times (``resources.task_retries``: the flows submit through
:func:`with_retries`) except on errors a retry cannot fix
(:func:`is_permanent`: bad data, config, reward function, experiment identity, an unusable
checkpoint, missing credentials — raised in the flow process or inside a rank), never caches
through Prefect (storage is the record: a deleted experiment is never "resumed" from a stale
cache) and persists no Prefect result. A dead rank, an S3 5xx, a timeout are retried.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast, overload

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from ppoflow.infra.checkpoint.sharded import CorruptCheckpointError, IncompleteCheckpointError
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.data.prompts import DataError
from ppoflow.infra.experiment.lock import ExperimentLocked
from ppoflow.infra.experiment.manifest import ExperimentPaths, ManifestConflict, now_iso
from ppoflow.infra.preflight import PreflightError
from ppoflow.infra.remote.contracts import Role, WorkerContract
from ppoflow.infra.remote.errors import GroupCannotStart, RankFailure
from ppoflow.infra.rewards import RewardError
from ppoflow.infra.runtime import faults
from ppoflow.tasks.graph import STEP, StepSpec, WiringError
from ppoflow.tasks.receipts import R, Receipt, find_receipt, input_stamps, write_receipt
from ppoflow.tasks.replay import ReplayError
from ppoflow.tasks.run import RunClosed, RunContext, get_run

__all__ = [
    "ppo_task",
    "Step",
    "TASK_OPTIONS",
    "TASK_RETRIES",
    "with_retries",
    "PERMANENT_ERRORS",
    "is_permanent",
    "retryable",
    "Timer",
    "task_logs",
    "shorten",
]

TASK_RETRIES = 2


def artifact_slug(text: str) -> str:
    """``text`` as a Prefect artifact key: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "experiment"


def shorten(text: str, limit: int = 300) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks a cut), for artifact tables people read."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _credential_errors() -> tuple[type[BaseException], ...]:
    try:
        from botocore.exceptions import NoCredentialsError
    except ImportError:  # no S3 support installed
        return ()
    return (NoCredentialsError,)


#: Errors a retry cannot fix: the same inputs fail the same way. ``PermissionError`` covers a
#: read-only directory and S3's AccessDenied (s3fs raises it for HTTP 403).
PERMANENT_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,  # IdentityMismatch (a changed model or tokenizer) included
    DataError,
    PreflightError,
    RewardError,
    IncompleteCheckpointError,
    CorruptCheckpointError,  # a file's size or content hash differs from its marker
    ReplayError,  # a state to rebuild lost a batch (or its record): a rollback is the way out
    ExperimentLocked,
    ManifestConflict,
    RunClosed,
    GroupCannotStart,  # a worker group whose ranks fail at start the same way every time
    PermissionError,
    *_credential_errors(),
)


_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def storage_full(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it was raised from, or a rank's error it reports) is a
    full filesystem or an exhausted quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "errno", None) in _FULL or any(text in str(exc) for text in _FULL.values()):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


MAX_CAUSE_LINES = 24


def cause_text(exc: BaseException | None) -> str:
    """The exception's type and message, up to the first detail section (a rank's traceback or
    output tail, marked ``--- ...``) and at most :data:`MAX_CAUSE_LINES` lines."""
    if exc is None:
        return "unknown (see the log)"
    lines = []
    for line in f"{type(exc).__name__}: {exc}".splitlines():
        if line.startswith("--- "):
            lines.append("(the ranks' traceback and output are in the log)")
            break
        lines.append(line)
    if len(lines) > MAX_CAUSE_LINES:
        lines = lines[:MAX_CAUSE_LINES] + ["... (the rest is in the log)"]
    return "\n         ".join(lines)


def is_permanent(exc: BaseException | None) -> bool:
    """True when retrying cannot help: a :data:`PERMANENT_ERRORS` raised here, or inside a rank
    (a :class:`RankFailure` carries the rank exception's class names), or a full filesystem (a
    retry a second later meets the same disk). A dead rank, an S3 5xx or a timeout are not
    permanent."""
    if storage_full(exc):
        return True
    if isinstance(exc, RankFailure):
        return exc.raised(*PERMANENT_ERRORS)
    return isinstance(exc, PERMANENT_ERRORS)


def retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry unless the failure :func:`is_permanent`."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classified, not handled
        return not is_permanent(exc)
    return True


_Task = TypeVar("_Task", bound=Task)
C = TypeVar("C")  # a worker group's contract (``Step.worker``)


def with_retries(task: _Task, retries: int) -> _Task:
    """``task`` retried ``retries`` times (``resources.task_retries``) instead of
    :data:`TASK_RETRIES`: what a flow submits."""
    return task if retries == TASK_RETRIES else cast(_Task, task.with_options(retries=retries))


TASK_OPTIONS: dict[str, Any] = dict(
    retries=TASK_RETRIES,
    retry_delay_seconds=1,
    retry_condition_fn=retryable,
    cache_policy=NO_CACHE,
    persist_result=False,
)


class Timer:
    """Wall-clock seconds of a block: ``with Timer() as t: ...; t.seconds``."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


@contextlib.contextmanager
def task_logs(ctx: RunContext, *roles: str) -> Iterator[Any]:
    """The task's Prefect logger, with the rank output of ``roles`` routed into it."""
    from prefect import get_run_logger

    logger = get_run_logger()
    with contextlib.ExitStack() as stack:
        for role in roles:
            stack.enter_context(ctx.using(role, logger))
        yield logger


@dataclass
class Step(Generic[R]):
    """What a task body works with: the run's context, the iteration, the task's logger, its row."""

    ctx: RunContext
    n: int
    task: str
    kind: type[R]
    logger: Any
    spec: StepSpec
    held: list[str] = field(default_factory=list)
    replays: dict[str, float] = field(default_factory=dict)  # states rebuilt for this task

    @property
    def cfg(self) -> ExperimentConfig:
        return self.ctx.cfg

    @property
    def paths(self) -> ExperimentPaths:
        return self.ctx.paths

    @property
    def slug(self) -> str:
        """The experiment's name as a Prefect artifact key (lowercase letters, digits, dashes)."""
        return artifact_slug(self.cfg.storage.experiment)

    def file(self, name: str) -> str:
        """The URL of ``name`` in this iteration's directory (``iterations/{n:06d}/name``)."""
        return self.paths.file(self.n, name)

    @property
    def output_key(self) -> str:
        """The key of the output later steps read from this step's receipt (its row's ``output``)."""
        if self.spec.output is None:
            raise WiringError(f"step {self.task!r} has no output in its row")
        return self.spec.output

    @overload
    def worker(self, role: Role[C], state: str | None = None) -> C: ...
    @overload
    def worker(self, role: str | None = None, state: str | None = None) -> WorkerContract: ...
    def worker(self, role: Role[Any] | str | None = None, state: str | None = None) -> Any:
        """``role``'s worker group (None: the row's), started (or rebuilt) if needed and holding
        checkpoint ``state`` (None: any), typed as its contract: ``CRITIC_ROLE`` gives a
        ``CriticContract`` (``ppoflow.infra.remote.contracts``; a name, the methods every worker
        has). The task holds the group until it ends (no other task changes its state meanwhile)."""
        asked = role.name if isinstance(role, Role) else role
        if asked is not None and self.spec.role is not None and asked != self.spec.role:
            raise WiringError(
                f"step {self.task!r} asks for the {asked!r} worker group, but its row in "
                f"ppoflow.tasks.graph.STEPS runs it on {self.spec.role!r}: call step.worker() with the "
                "row's role, or change the row"
            )
        role = asked or self.spec.role
        if role is None:
            raise WiringError(f"step {self.task!r} runs on no worker group (its row has no role)")
        if role not in self.held:
            self.ctx.groups.acquire(role)
            self.held.append(role)
        handle = self.ctx.groups.worker(role, state, progress=self.logger.info)
        self.replays.update(self.ctx.groups.take_replays(role))
        return handle

    def release(self) -> None:
        """Let go of the groups :meth:`worker` held (the decorator calls it)."""
        while self.held:
            self.ctx.groups.release(self.held.pop())

    def receipt(self, **fields: Any) -> R:
        """This task's receipt for iteration ``n`` (the decorator adds the timing)."""
        return self.kind(task=self.task, iteration=self.n, **fields)


def _row(step: str | StepSpec) -> StepSpec:
    if isinstance(step, StepSpec):
        return step
    if step not in STEP:
        raise WiringError(
            f"step {step!r} has no row in ppoflow.tasks.graph.STEPS: add one (docs/internals.md, 'Adding a step')"
        )
    return STEP[step]


def _check_wiring(spec: StepSpec, body: Callable[..., Any]) -> list[inspect.Parameter]:
    """The body's parameters after ``step``, once they are its row's inputs (WiringError otherwise)."""
    params = list(inspect.signature(body).parameters.values())[1:]
    required = [p.name for p in params if p.default is p.empty]
    optional = [p.name for p in params if p.default is not p.empty]
    spec.check_parameters(required, optional, f"{body.__module__}.{body.__qualname__}")
    return params


# Two overloads so that ``kind`` defaults to Receipt for the type checker too.
@overload
def ppo_task(step: str | StepSpec) -> Callable[[Callable[..., Receipt]], Task[..., Receipt]]: ...
@overload
def ppo_task(step: str | StepSpec, kind: type[R]) -> Callable[[Callable[..., R]], Task[..., R]]: ...
def ppo_task(step: str | StepSpec, kind: type[Any] = Receipt) -> Callable[[Callable[..., Any]], Any]:
    """Make ``body(step, **inputs)`` the Prefect task of step ``step`` (a row of
    :data:`~ppoflow.tasks.graph.STEPS` by name, or a row of its own):
    ``name(run, n, **inputs) -> kind`` (module docstring)."""
    spec = _row(step)
    name = spec.name

    def deco(body: Callable[..., R]) -> Task[..., R]:
        params = _check_wiring(spec, body)

        @functools.wraps(body)
        def run_step(run: str, n: int, *args: Any, **kwargs: Any) -> R:
            ctx = get_run(run)
            inputs = input_stamps(ctx.paths, args, kwargs)
            done = find_receipt(ctx.paths, n, name, kind, inputs=inputs, settle=ctx.writes.wait_quietly)
            if done is not None:
                return done
            faults.maybe_fail(name, "before", n)
            if ctx.lock is not None:
                ctx.lock.check()  # a run that lost its lease writes nothing more
            with task_logs(ctx, *spec.roles) as logger, Timer() as timer:
                step = Step(ctx, n, name, kind, logger, spec)
                try:
                    receipt = body(step, *args, **kwargs)
                finally:
                    step.release()
            receipt = receipt.model_copy(
                update={
                    "timing_s": timer.seconds,
                    "finished_at": now_iso(),
                    "inputs": inputs,
                    "metrics": {**receipt.metrics, **step.replays},
                }
            )
            if ctx.lock is not None:
                ctx.lock.check()
            receipt = write_receipt(ctx.paths, receipt)
            faults.maybe_fail(name, "after", n)
            return receipt

        # Prefect binds the call's arguments with the signature: (run, n, <the body's after step>).
        head = [
            inspect.Parameter("run", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
            inspect.Parameter("n", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int),
        ]
        # inspect.signature() reads __signature__; typeshed's functools._Wrapped does not declare it
        run_step.__signature__ = inspect.Signature(head + params, return_annotation=kind)  # type: ignore[attr-defined]
        del run_step.__wrapped__  # signature() must not look through
        return cast(Task[..., R], task(name=name, task_run_name=f"{name}-{{n}}", **TASK_OPTIONS)(run_step))

    return deco
