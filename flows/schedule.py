"""The order of a run's tasks: one iteration's graph, pipelined commits, and one-step overlap.

Each iteration n runs the steps of :data:`ppoflow.tasks.graph.STEPS` that its config turns on (the
table says what each reads, where it runs and when; docs/internals.md shows the picture), placed by
their rows' ``phase`` alone: the ``rollout`` and ``score`` phases (the *data side*: the rollout, its
reads, the advantages), then the ``update`` phase, then ``publish``, then the ``evaluate`` phase
every ``evaluation.every`` iterations (and at a run's end), then the ``commit``; rows with
``at_start`` also run once before the first iteration. Every task is called with keyword arguments
its row names (:meth:`~ppoflow.tasks.graph.StepSpec.arguments`): the receipts of the steps it reads,
the fields of the iteration's :class:`Start` it names, its phase's options.

``commit n`` is *submitted*, not awaited: it waits in the background for checkpoint n (written by
the groups after the update tasks returned) while iteration n+1 already runs on the live weights.
Commits stay in order (commit n+1 takes commit n's future as its ``previous``), and a failed
commit stops the run at the next iteration boundary. Nothing of iteration n+1 needs commit n: it
starts from a :class:`Start` built from iteration n's receipts (the checkpoints' URLs, the data
cursor after the batch, the KL coefficient), exactly what manifest n will say.

``algorithm.overlap: one_step`` changes which weights the data side uses. Iteration k's rollout,
old log-probs and values come from the actor and critic after update k-2 (the base weights for
k <= 2); its updates start from checkpoint k-1 as always. So, while iteration n is being trained,
iteration n+1 is generated from the weights update n starts from, which are live in the groups:

    actor group:   generate n+1 -> ref_log_prob n+1 -> update_actor n  -> generate n+2 -> ...
    critic group:  values n+1                       -> update_critic n -> values n+2   -> ...

and the advantage, reward model and commit work of one iteration overlaps the actor group's work
on the next. The PPO ratio's denominator is the log-prob under the policy that sampled (k-2),
recomputed by the FSDP actor in ``generate``, and is clipped as usual. A run that resumes at
manifest m generates iteration m+1 from what manifest m records (``rollout_checkpoints``: the
checkpoints of m-1), so the result does not depend on where runs stop and start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.futures import PrefectFuture, wait

from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest
from ppoflow.tasks import TASKS, commit
from ppoflow.tasks import graph as iteration_graph
from ppoflow.tasks.evaluate import due
from ppoflow.tasks.graph import Phase, StepSpec, needs_reference
from ppoflow.tasks.receipts import IterationReceipts, R
from ppoflow.tasks.run import RunContext
from ppoflow.tasks.step import cause_text, with_retries

__all__ = ["Start", "run_iterations", "needs_reference", "pending_roles"]


def _results(futures: list[PrefectFuture[R]]) -> list[R]:
    """Wait for every future, then return their results in order (raising the first failure)."""
    wait(futures)
    return [f.result() for f in futures]


def pending_roles(ctx: RunContext, n: int) -> list[str]:
    """The worker groups that unfinished steps of iteration ``n`` will need (a step is finished
    when its receipt is on storage)."""
    return iteration_graph.pending_roles(ctx.cfg, lambda step: not storage.exists(ctx.paths.receipt(n, step)))


@dataclass(frozen=True)
class Start:
    """Where iteration ``iteration + 1`` starts (URLs): the updates from ``actor``/``critic``, the
    rollout and values from ``rollout_actor``/``rollout_critic`` (the same, except one step older
    with one-step overlap), the data at ``cursor``, the KL coefficient ``kl_coef``. A row's
    ``state`` names these fields (:data:`~ppoflow.tasks.graph.StartField`)."""

    iteration: int
    actor: str
    critic: str | None
    rollout_actor: str
    rollout_critic: str | None
    cursor: DataCursor
    kl_coef: float | None

    @classmethod
    def of(cls, paths: ExperimentPaths, manifest: Manifest, one_step: bool) -> Start:
        actor, critic = paths.url(manifest.actor_checkpoint), paths.url(manifest.critic_checkpoint)
        rollout = manifest.rollout_checkpoints if one_step and manifest.rollout_checkpoints else {}
        return cls(
            iteration=manifest.iteration,
            actor=actor,
            critic=critic,
            rollout_actor=paths.url(rollout.get("actor")) or actor,
            rollout_critic=paths.url(rollout.get("critic")) or critic,
            cursor=manifest.data_cursor,
            kl_coef=manifest.kl_coef,
        )

    def after(self, receipts: IterationReceipts, one_step: bool) -> Start:
        """The start of the iteration after the one ``receipts`` belong to."""
        actor = receipts.checkpoint("actor") or self.actor
        critic = receipts.checkpoint("critic") or self.critic
        return Start(
            iteration=self.iteration + 1,
            actor=actor,
            critic=critic,
            rollout_actor=self.actor if one_step else actor,
            rollout_critic=self.critic if one_step else critic,
            cursor=receipts.generate.next_cursor,
            kl_coef=receipts.advantage.kl_coef,
        )

    def rollout_record(self) -> dict[str, str | None] | None:
        """What manifest ``iteration`` records for the next rollout when it is not the new
        checkpoints (``Manifest.rollout_checkpoints``)."""
        if self.rollout_actor == self.actor and self.rollout_critic == self.critic:
            return None
        return {"actor": self.rollout_actor, "critic": self.rollout_critic}


def _submit(
    ctx: RunContext,
    spec: StepSpec,
    n: int,
    start: Start,
    ran: dict[str, PrefectFuture[Any]],
    given: dict[str, Any] | None = None,
    wait_for: list[PrefectFuture[Any]] | None = None,
) -> PrefectFuture[Any]:
    """Submit ``spec``'s task for iteration ``n`` with the keyword arguments its row names: the
    steps it reads from those that ``ran``, the fields of ``start``, its options from ``given``."""
    kwargs = spec.arguments(ran, start, given or {})
    task = with_retries(TASKS[spec.name], ctx.cfg.resources.task_retries)
    return task.submit(ctx.key, n, wait_for=wait_for, **kwargs)


@dataclass
class _Data:
    """The data side of one iteration, submitted: the futures of its steps by name, and the same
    under the names later steps read them as (a step that ``provides`` another, e.g. ``consume``
    read as ``generate``)."""

    futures: dict[str, PrefectFuture[Any]]
    reads: dict[str, PrefectFuture[Any]]

    def users(self, role: str) -> list[PrefectFuture[Any]]:
        """The submitted steps that run on ``role``'s group (an update of that group waits for them)."""
        return [f for name, f in self.futures.items() if iteration_graph.STEP[name].role == role]

    def iteration(self) -> IterationReceipts:
        """The data side's receipts (waiting for them; the first failure raises)."""
        return IterationReceipts.of(list(self.receipts().values()))

    def receipts(self) -> dict[str, Any]:
        """The receipts of the data side's steps by name (waiting for them; the first failure raises)."""
        return dict(zip(self.futures, _results(list(self.futures.values()))))


def _submit_data(ctx: RunContext, n: int, start: Start) -> _Data:
    """Submit the ``rollout`` and ``score`` steps of iteration ``n`` that the config turns on."""
    futures: dict[str, PrefectFuture[Any]] = {}
    reads: dict[str, PrefectFuture[Any]] = {}
    for spec in iteration_graph.steps(ctx.cfg, ("rollout", "score")):
        futures[spec.name] = reads[spec.name] = _submit(ctx, spec, n, start, reads)
        if spec.provides:
            reads[spec.provides] = futures[spec.name]
    return _Data(futures, reads)


def _updates(
    ctx: RunContext, n: int, start: Start, data: _Data, upcoming: _Data | None, last: bool
) -> IterationReceipts:
    """Submit iteration ``n``'s updates (after the data side of ``n + 1`` with one-step overlap:
    the groups generate first, then train), then the ``publish`` phase's rows (what publishes their
    result), and wait for them; the iteration's receipts. ``last``:
    the end of a run, whose snapshot (``checkpoint.snapshot_at_end``: whatever ``snapshot_every``
    says) its commit waits for."""
    done = data.receipts()
    given = {"snapshot": last and ctx.cfg.checkpoint.snapshot_at_end, "final": last}
    ran = dict(data.reads)
    phases: tuple[Phase, ...] = ("update", "publish")  # publish: e.g. the new policy, for the producers
    for spec in iteration_graph.steps(ctx.cfg, phases):
        waits = upcoming.users(spec.role or "") if upcoming and spec.phase == "update" else None
        ran[spec.name] = _submit(ctx, spec, n, start, ran, given, wait_for=waits)
    later = [f for name, f in ran.items() if name not in data.reads]
    return IterationReceipts.of([*done.values(), *_results(later)])


def _next_data_side(ctx: RunContext, n: int, start: Start, data: _Data) -> Start:
    """Where iteration ``n + 1``'s data side starts with one-step overlap: rollout and values from
    the weights iteration ``n`` trains from (live in the groups), the updates from checkpoint n."""
    done = data.iteration()
    critic = ctx.paths.checkpoint("critic", n) if ctx.cfg.critic.enable else start.critic
    return Start(
        iteration=n,
        actor=ctx.paths.checkpoint("actor", n),
        critic=critic,
        rollout_actor=start.actor,
        rollout_critic=start.critic,
        cursor=done.generate.next_cursor,
        kl_coef=done.advantage.kl_coef,
    )


def _at_start(ctx: RunContext, start: Start) -> None:
    """Run the rows placed at a run's start (``at_start``), as the iteration the run starts from."""
    openers = [spec for spec in iteration_graph.steps(ctx.cfg) if spec.at_start is not None]
    if openers:
        ctx.groups.prestart(pending_roles(ctx, start.iteration + 1))
    for spec in openers:
        task = with_retries(TASKS[spec.name], ctx.cfg.resources.task_retries)
        task(ctx.key, start.iteration, **spec.opening_arguments(start))


def _evaluations(ctx: RunContext, n: int, start: Start, last: bool) -> list[PrefectFuture[Any]]:
    """Submit the ``evaluate`` phase of iteration ``n`` if it is due (on the actor group, holding
    update n); ``start`` is the next iteration's (its ``actor``: checkpoint n)."""
    if not due(ctx.cfg, n, last_of_run=last):
        return []
    return [_submit(ctx, spec, n, start, {}) for spec in iteration_graph.steps(ctx.cfg, ("evaluate",))]


class _Commits:
    """The run's submitted commits, reported in order as each lands (``on_commit(manifest,
    metrics)`` in the flow's thread); a failed commit raises where it is reported. A commit also
    takes futures of other tasks as inputs (the iteration's evaluation): when one of them fails, the
    commit never runs (Prefect leaves it pending), so that input's own error is what is raised."""

    def __init__(self, ctx: RunContext, manifest: Manifest, on_commit: Any):
        self.ctx, self.on_commit = ctx, on_commit
        self.pending: list[tuple[PrefectFuture[Manifest], list[PrefectFuture[Any]]]] = []
        self.last: tuple[Manifest, dict[str, Any]] = (manifest, {})

    def add(self, future: PrefectFuture[Manifest], inputs: list[PrefectFuture[Any]]) -> None:
        self.pending.append((future, inputs))

    @staticmethod
    def _finished(future: PrefectFuture[Any]) -> bool:
        future.wait(timeout=0)  # records the final state once the task returned
        return future.state.is_final()

    def _landed(self, entry: tuple[PrefectFuture[Manifest], list[PrefectFuture[Any]]]) -> bool:
        future, inputs = entry
        return self._finished(future) or any(self._finished(f) and f.state.is_failed() for f in inputs)

    def report(self, block: bool) -> None:
        """Report the commits that landed (with ``block``: all of them, waiting)."""
        while self.pending and (block or self._landed(self.pending[0])):
            future, inputs = self.pending.pop(0)
            for f in inputs:
                f.result()  # a failed input raises its own error (the commit never ran)
            done = future.result()  # raises if the commit failed: the run stops here
            self.last = (done, storage.read_json(self.ctx.paths.file(done.iteration, "metrics.json")))
            self.on_commit(*self.last)

    def drain(self) -> None:
        """After the loop ended (or failed): let the pending commits land (they wait only for
        their checkpoints) and report them; a failure here is logged, not raised, so the error
        that stopped the run is the one raised."""
        if not self.pending:
            return
        for future, inputs in self.pending:
            wait(inputs)
            if not any(f.state.is_failed() for f in inputs):
                wait([future])
        try:
            self.report(block=True)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            get_run_logger().warning(f"a pending commit failed too: {cause_text(exc)}")


def run_iterations(
    ctx: RunContext, manifest: Manifest, iterations: int, on_commit: Any
) -> tuple[Manifest, dict[str, Any]]:
    """Run ``iterations`` iterations after ``manifest``; ``on_commit(manifest, metrics)`` is called
    (in the flow's thread) for each commit in order. Returns the last (manifest, metrics)."""
    one_step = ctx.cfg.algorithm.overlap == "one_step"
    retries = ctx.cfg.resources.task_retries
    start = Start.of(ctx.paths, manifest, one_step)
    if iterations:
        _at_start(ctx, start)
    previous: Manifest | PrefectFuture[Manifest] = manifest
    commits = _Commits(ctx, manifest, on_commit)
    data: _Data | None = None
    try:
        for i in range(iterations):
            n = start.iteration + 1
            started = time.time()
            ctx.groups.prestart(pending_roles(ctx, n))
            data = data or _submit_data(ctx, n, start)
            upcoming = None
            if one_step and i + 1 < iterations:
                upcoming = _submit_data(ctx, n + 1, _next_data_side(ctx, n, start, data))
            last = i + 1 == iterations
            receipts = _updates(ctx, n, start, data, upcoming, last)
            start = start.after(receipts, one_step)
            evaluated = _evaluations(ctx, n, start, last)
            # the pipelined commit: its arguments are the iteration's, not a row's inputs.
            # Prefect resolves a future argument; submit's ParamSpec typing allows only a Manifest
            previous = with_retries(commit, retries).submit(
                run=ctx.key,
                n=n,
                previous=previous,  # type: ignore[arg-type]
                receipts=receipts,
                started=started,
                rollout_checkpoints=start.rollout_record(),
                evaluation=evaluated[0] if evaluated else None,  # type: ignore[arg-type]
            )
            commits.add(previous, evaluated)
            data = upcoming
            commits.report(block=False)
        commits.report(block=True)
    finally:
        commits.drain()
    return commits.last
