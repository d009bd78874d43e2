"""The iteration, declared once: the table of a PPO iteration's steps.

Every step is one row of :data:`STEPS`, a :class:`StepSpec` built by keyword: its name (its
Prefect task's and receipt's), the worker group it runs on (``role``) and what of that group's
worker it uses (``uses``), its stage (the steps of one stage run side by side), where the schedule
places it (``phase``, ``at_start``), its inputs, the Arrow output later steps read from its
receipt, and when it runs given the config. The row is the single source of a step's wiring: its
task (:func:`ppoflow.tasks.step.ppo_task`) takes its role and output key from the row and is
refused at import unless its parameters are the row's inputs, by name and in order::

    task(run, n, *reads, [gathered], *state, *options)

``reads``: the receipts of the named steps; ``gathered``: one list, the receipts of the steps the
row ``gathers`` that ran; ``state``: fields of the iteration's start (:data:`StartField`);
``options``: parameters with defaults the schedule gives by phase (:data:`Option`). The schedule
(:mod:`ppoflow.flows.schedule`) passes them by keyword (:meth:`StepSpec.arguments`) and places
each row by its ``phase``: ``rollout`` and ``score`` (the data side) then ``update`` then
``publish`` every iteration, ``evaluate`` every evaluation, ``commit`` pipelined; a row with
``at_start`` also runs once when a run starts, each read given that field of the start.

Derived from the table: :func:`steps`, :func:`pending_roles`, :func:`actor_group_role`,
:func:`trained_roles`, :func:`writers`, :func:`critical_path`, :func:`picture` (the README and
docs/internals.md show it).

Asynchronous training (docs/async.md) swaps rows, not the schedule: ``consume`` takes the batch
from the queue and *provides* ``generate`` (the steps that read the rollout read it),
``old_log_prob`` recomputes the PPO ratio's denominator on the actor, ``publish_policy`` writes the
policy after ``update_actor`` (and, at a run's start, the one it starts from) for the producers.
Adding a step: docs/internals.md, "Adding a step".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the table stays importable without the config's models
    from ppoflow.infra.config import ExperimentConfig

__all__ = [
    "StepSpec",
    "STEPS",
    "STEP",
    "GATHERED",
    "Phase",
    "StartField",
    "Option",
    "WiringError",
    "steps",
    "pending_roles",
    "trained_roles",
    "critical_path",
    "picture",
    "needs_reference",
    "has_teacher",
    "asynchronous",
    "output_of",
    "writers",
    "actor_group_role",
]

Phase = Literal["rollout", "score", "update", "publish", "evaluate", "commit"]
Role = Literal["actor", "critic", "reward_model"]
#: What of its group's worker a step uses besides the trained model (``actor_group_role``).
Use = Literal["rollout", "ref", "teacher"]
#: The fields of the iteration's start a row's ``state`` names (``flows.schedule.Start``).
StartField = Literal["actor", "critic", "rollout_actor", "rollout_critic", "cursor", "kl_coef"]
#: The options the schedule gives by phase (``update``: a snapshot at a run's end, its last iteration).
Option = Literal["snapshot", "final"]
#: The name of the parameter that takes the receipts of the steps a row ``gathers``.
GATHERED = "gathered"


class WiringError(TypeError):
    """A task whose parameters are not its row's inputs, or a row the table cannot hold."""


def needs_reference(cfg: ExperimentConfig) -> bool:
    """True when a KL term (in the reward or as a loss) needs the reference policy's log-probs."""
    return bool(cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss)


def has_teacher(cfg: ExperimentConfig) -> bool:
    """True when a teacher is configured (on-policy distillation): its log-probs are a step."""
    return getattr(cfg, "teacher", None) is not None


def _critic(cfg: ExperimentConfig) -> bool:
    return bool(cfg.critic.enable)


def _reward_model(cfg: ExperimentConfig) -> bool:
    return bool(cfg.reward.reward_model.enable)


def asynchronous(cfg: ExperimentConfig) -> bool:
    """True when the iteration consumes its rollout from the queue (``asynchronous.enable``)."""
    return bool(cfg.asynchronous.enable)


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One step of the iteration (see the module docstring)."""

    name: str
    stage: int
    phase: Phase
    role: Role | None = None
    uses: tuple[Use, ...] = ()
    reads: tuple[str, ...] = ()
    gathers: tuple[str, ...] = ()
    state: tuple[StartField, ...] = ()
    options: tuple[Option, ...] = ()
    output: str | None = None
    provides: str | None = None  # the step later steps read it as (it stands in for that step)
    at_start: StartField | None = None
    runs_if: Callable[[ExperimentConfig], bool] | None = None  # None: always
    when: str = ""

    def runs(self, cfg: ExperimentConfig) -> bool:
        """Whether this step runs in an iteration of ``cfg``."""
        return self.runs_if is None or self.runs_if(cfg)

    @property
    def roles(self) -> tuple[str, ...]:
        """The worker groups whose rank output goes into the task's log."""
        return (self.role,) if self.role is not None else ()

    @property
    def parameters(self) -> tuple[str, ...]:
        """The task's parameters after ``step`` that take no default, in order."""
        return (*self.reads, *((GATHERED,) if self.gathers else ()), *self.state)

    def arguments(self, ran: Mapping[str, Any], start: object, given: Mapping[str, Any]) -> dict[str, Any]:
        """The task's keyword arguments: the steps it reads from those that ``ran`` (by the name
        later steps read them as), the fields of ``start`` it names, its options from ``given``."""
        args = {name: ran[name] for name in self.reads}
        if self.gathers:
            args[GATHERED] = [ran[name] for name in self.gathers if name in ran]
        args.update({name: getattr(start, name) for name in self.state})
        args.update({name: given[name] for name in self.options})
        return args

    def opening_arguments(self, start: object) -> dict[str, Any]:
        """The task's keyword arguments at a run's start: each read given the ``at_start`` field."""
        if self.at_start is None:
            raise WiringError(f"step {self.name!r} does not run at a run's start (its row has no at_start)")
        return {name: getattr(start, self.at_start) for name in self.reads}

    def check_parameters(self, required: Sequence[str], optional: Sequence[str], task: str) -> None:
        """Raise :class:`WiringError` unless ``task``'s parameters after ``step`` are this row's:
        ``required`` (no default) its reads, ``gathered`` and state, ``optional`` its options."""
        if tuple(required) == self.parameters and tuple(optional) == self.options:
            return
        want = ", ".join([*self.parameters, *(f"{o}=..." for o in self.options)])
        found = ", ".join([*required, *(f"{o}=..." for o in optional)])
        raise WiringError(
            f"step {self.name!r}: its task {task} takes (step, {found}), but its row in "
            f"ppoflow.tasks.graph.STEPS wires (step, {want}): the steps it reads {list(self.reads)}, "
            f"{GATHERED!r} for the steps it gathers, the start's fields {list(self.state)}, then the "
            f"options {list(self.options)} with defaults. Rename the task's parameters or fix the row"
        )


_ASYNC = "with asynchronous training"

STEPS: tuple[StepSpec, ...] = (
    StepSpec(
        name="generate",
        stage=0,
        phase="rollout",
        role="actor",
        uses=("rollout",),
        state=("rollout_actor", "cursor"),
        output="rollout",
        runs_if=lambda cfg: not asynchronous(cfg),
        when="without asynchronous training",
    ),
    StepSpec(
        name="consume",
        stage=0,
        phase="rollout",
        state=("cursor",),
        output="rollout",
        provides="generate",
        runs_if=asynchronous,
        when=_ASYNC,
    ),
    StepSpec(
        name="old_log_prob",
        stage=1,
        phase="score",
        role="actor",
        reads=("generate",),
        state=("actor",),
        output="old_log_prob",
        runs_if=asynchronous,
        when=_ASYNC,
    ),
    StepSpec(
        name="ref_log_prob",
        stage=1,
        phase="score",
        role="actor",
        uses=("ref",),
        reads=("generate",),
        output="ref_log_prob",
        runs_if=needs_reference,
        when="with a KL term",
    ),
    StepSpec(
        name="teacher_log_prob",
        stage=1,
        phase="score",
        role="actor",
        uses=("teacher",),
        reads=("generate",),
        output="teacher_log_prob",
        runs_if=has_teacher,
        when="with a teacher",
    ),
    StepSpec(
        name="values",
        stage=1,
        phase="score",
        role="critic",
        reads=("generate",),
        state=("rollout_critic",),
        output="values",
        runs_if=_critic,
        when="with a critic",
    ),
    StepSpec(
        name="rm_score",
        stage=1,
        phase="score",
        role="reward_model",
        reads=("generate",),
        output="rm_score",
        runs_if=_reward_model,
        when="with a reward model",
    ),
    StepSpec(
        name="advantage",
        stage=2,
        phase="score",
        reads=("generate",),
        gathers=("old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score"),
        state=("kl_coef",),
        output="advantages",
    ),
    StepSpec(
        name="update_actor",
        stage=3,
        phase="update",
        role="actor",
        reads=("advantage",),
        state=("actor",),
        options=("snapshot", "final"),
    ),
    StepSpec(
        name="update_critic",
        stage=3,
        phase="update",
        role="critic",
        reads=("advantage",),
        state=("critic",),
        options=("snapshot", "final"),
        runs_if=_critic,
        when="with a critic",
    ),
    StepSpec(
        name="publish_policy",
        stage=4,
        phase="publish",
        role="actor",
        reads=("update_actor",),
        at_start="actor",
        runs_if=asynchronous,
        when=_ASYNC,
    ),
    StepSpec(
        name="evaluate",
        stage=4,
        phase="evaluate",
        role="actor",
        uses=("rollout",),
        state=("actor",),  # the start after the iteration: its update's actor
        runs_if=lambda cfg: bool(cfg.data.val_files),
        when="every evaluation.every iterations and at a run's end, with data.val_files",
    ),
    StepSpec(name="commit", stage=5, phase="commit"),
)

#: The rows by name.
STEP: dict[str, StepSpec] = {s.name: s for s in STEPS}


def _check(table: Iterable[StepSpec]) -> None:
    """Every step reads only steps of earlier stages (or a step standing in for one: ``provides``);
    names are unique."""
    seen: dict[str, int] = {}
    names: set[str] = set()
    for s in table:
        if s.name in names:
            raise WiringError(f"step {s.name!r} is declared twice")
        names.add(s.name)
        for up in (*s.reads, *s.gathers):
            if seen.get(up, s.stage) >= s.stage:
                raise WiringError(f"step {s.name!r} reads {up!r}, which is not a step of an earlier stage")
        for name in (s.name, s.provides):
            if name is not None:
                seen[name] = min(seen.get(name, s.stage), s.stage)


_check(STEPS)


def steps(cfg: ExperimentConfig, phases: Iterable[Phase] | None = None) -> list[StepSpec]:
    """The rows that run under ``cfg`` (of ``phases`` only, when given), in table order."""
    wanted = set(phases) if phases is not None else None
    return [s for s in STEPS if s.runs(cfg) and (wanted is None or s.phase in wanted)]


def output_of(step: str) -> str:
    """The name of the Arrow output later steps read from ``step``'s receipt."""
    out = STEP[step].output
    if out is None:
        raise KeyError(f"step {step!r} has no output later steps read")
    return out


def writers(output: str) -> tuple[str, ...]:
    """The steps whose receipt holds ``output`` for later steps (``rollout``: generate, consume)."""
    return tuple(s.name for s in STEPS if s.output == output)


def pending_roles(cfg: ExperimentConfig, missing: Callable[[str], bool]) -> list[str]:
    """The worker groups that the unfinished steps of an iteration need (``missing(step)``: no
    receipt yet), in the table's order of roles; evaluation is not counted (it runs on the actor
    group that the update just used)."""
    roles: list[str] = []
    for s in steps(cfg, ("rollout", "score", "update", "publish")):
        if s.role is not None and s.role not in roles and missing(s.name):
            roles.append(s.role)
    return roles


def trained_roles(cfg: ExperimentConfig) -> list[str]:
    """The roles an iteration updates: the ones with checkpoints (``actor``, and ``critic`` with a
    critic), in table order."""
    return [s.role for s in steps(cfg, ("update",)) if s.role is not None]


def actor_group_role(cfg: ExperimentConfig) -> str:
    """What the actor group's worker holds in a training run of ``cfg``, from what the steps that
    run on it use (``uses``): always the trained actor; the rollout engine when a step samples
    (``generate``, ``evaluate``); the reference policy when one scores with it (a KL term: without
    one no frozen copy of the model is built). One of the worker's roles (``actor_rollout_ref``,
    ``actor_rollout``, ``actor_ref``, ``actor``), with the ``+teacher`` flag when a step uses the
    frozen teacher."""
    used = {u for s in steps(cfg) if s.role == "actor" for u in s.uses}
    parts = ["actor", *(u for u in ("rollout", "ref") if u in used)]
    return "_".join(parts) + ("+teacher" if "teacher" in used else "")


def critical_path() -> list[tuple[str, ...]]:
    """The iteration's stages in order, each the steps that run side by side (the slowest counts)."""
    stages: dict[int, list[str]] = {}
    for s in STEPS:
        stages.setdefault(s.stage, []).append(s.name)
    return [tuple(stages[k]) for k in sorted(stages)]


_SUP = "¹²³⁴⁵⁶⁷⁸⁹"


def picture() -> str:
    """The graph as text: one column per stage, the steps of a stage stacked; a step that does
    not always run carries a mark, and its condition is listed below under that mark."""
    notes = list(dict.fromkeys(s.when for s in STEPS if s.when))
    marks = {s.name: _SUP[notes.index(s.when)] for s in STEPS if s.when}
    columns = [[name + marks.get(name, "") for name in stage] for stage in critical_path()]
    widths = [max(len(c) for c in col) for col in columns]
    height = max(len(col) for col in columns)
    lines = []
    for row in range(height):
        cells = []
        for i, col in enumerate(columns):
            text = col[row] if row < len(col) else ""
            joint = " ─► " if row == 0 else "    "
            cells.append((joint if i else "") + text.ljust(widths[i]))
        lines.append("".join(cells).rstrip())
    lines.append("")
    lines += [f"{_SUP[i]} {text}" for i, text in enumerate(notes)]
    return "\n".join(lines)
