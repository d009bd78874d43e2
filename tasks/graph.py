"""The iteration, declared once: the table of a PPO iteration's steps.

Every step of an iteration is one row of :data:`STEPS`: its name (the Prefect task's name and its
receipt's file name), the worker group it runs on, its stage on the critical path (the steps of one
stage run side by side), what it reads, the Arrow output later steps read from its receipt, and
when it runs given the config. Everything that needs the graph derives it from here:

    steps(cfg)                   the rows that run under ``cfg``, in order
    pending_roles(cfg, missing)  the worker groups the unfinished steps of an iteration need
    actor_group_role(cfg)        what the actor group's worker builds (engine, reference, teacher: if a step uses it)
    trained_roles(cfg)           the roles whose state an iteration updates (checkpointed roles)
    critical_path()              the stages, for ``timing_s/critical_path``
    picture()                    the graph as text (the README and docs/internals.md show it)

The flow submits the rows of the ``rollout``, ``score``, ``update`` and ``publish`` phases generically
(:mod:`ppoflow.flows.schedule`): a step's task is called as ``task(run, n, *reads, [gathers],
*state, **options)``, where ``reads`` are the receipts of the named steps, ``gathers`` the receipts
of the named steps that run (one list; steps whose config turns them off are left out) and
``state`` fields of the iteration's start (``flows.schedule.Start``: ``rollout_actor``,
``actor``, ``kl_coef``, ...). ``evaluate`` (every ``evaluation.every`` iterations) and ``commit``
(pipelined, in order) are placed by the schedule itself; their rows give their stage and role.

Asynchronous training (``asynchronous.enable``, docs/async.md) swaps rows, not the schedule:
``consume`` takes the iteration's batch from the queue instead of ``generate`` sampling it (it
*provides* ``generate``: the steps that read the rollout read it), ``old_log_prob`` recomputes the
PPO ratio's denominator on the actor (decoupled PPO's proximal policy), and ``publish_policy``
writes the policy after ``update_actor`` for the producers.

Adding a step: write its task with :func:`ppoflow.tasks.step.ppo_task`, export it from
:mod:`ppoflow.tasks`, and add its row here (docs/internals.md, "Adding a step").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "StepSpec",
    "STEPS",
    "STEP",
    "steps",
    "pending_roles",
    "trained_roles",
    "critical_path",
    "picture",
    "needs_reference",
    "has_teacher",
    "output_of",
    "actor_group_role",
]

Phase = Literal["rollout", "score", "update", "publish", "evaluate", "commit"]


def needs_reference(cfg: Any) -> bool:
    """True when a KL term (in the reward or as a loss) needs the reference policy's log-probs."""
    return bool(cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss)


def has_teacher(cfg: Any) -> bool:
    """True when a teacher is configured (on-policy distillation): its log-probs are a step."""
    return getattr(cfg, "teacher", None) is not None


def _always(cfg: Any) -> bool:
    return True


def _critic(cfg: Any) -> bool:
    return bool(cfg.critic.enable)


def _reward_model(cfg: Any) -> bool:
    return bool(cfg.reward.reward_model.enable)


def _held_out(cfg: Any) -> bool:
    return bool(cfg.data.val_files)


def asynchronous(cfg: Any) -> bool:
    """True when the iteration consumes its rollout from the queue (``asynchronous.enable``)."""
    return bool(cfg.asynchronous.enable)


def _synchronous(cfg: Any) -> bool:
    return not asynchronous(cfg)


@dataclass(frozen=True)
class StepSpec:
    """One step of the iteration (see the module docstring)."""

    name: str
    stage: int
    phase: Phase
    role: str | None = None
    reads: tuple[str, ...] = ()
    gathers: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    output: str | None = None
    runs_if: Callable[[Any], bool] = _always
    when: str = ""
    provides: str | None = None  # the step later steps read it as (it stands in for that step)

    def runs(self, cfg: Any) -> bool:
        """Whether this step runs in an iteration of ``cfg``."""
        return self.runs_if(cfg)


_ASYNC = "with asynchronous training"

STEPS: tuple[StepSpec, ...] = (
    StepSpec(
        "generate",
        0,
        "rollout",
        "actor",
        state=("rollout_actor", "cursor"),
        output="rollout",
        runs_if=_synchronous,
        when="without asynchronous training",
    ),
    StepSpec(
        "consume",
        0,
        "rollout",
        state=("cursor",),
        output="rollout",
        runs_if=asynchronous,
        when=_ASYNC,
        provides="generate",
    ),
    StepSpec(
        "old_log_prob",
        1,
        "score",
        "actor",
        reads=("generate",),
        state=("actor",),
        output="old_log_prob",
        runs_if=asynchronous,
        when=_ASYNC,
    ),
    StepSpec(
        "ref_log_prob",
        1,
        "score",
        "actor",
        reads=("generate",),
        output="ref_log_prob",
        runs_if=needs_reference,
        when="with a KL term",
    ),
    StepSpec(
        "teacher_log_prob",
        1,
        "score",
        "actor",
        reads=("generate",),
        output="teacher_log_prob",
        runs_if=has_teacher,
        when="with a teacher",
    ),
    StepSpec(
        "values",
        1,
        "score",
        "critic",
        reads=("generate",),
        state=("rollout_critic",),
        output="values",
        runs_if=_critic,
        when="with a critic",
    ),
    StepSpec(
        "rm_score",
        1,
        "score",
        "reward_model",
        reads=("generate",),
        output="rm_score",
        runs_if=_reward_model,
        when="with a reward model",
    ),
    StepSpec(
        "advantage",
        2,
        "score",
        reads=("generate",),
        gathers=("old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score"),
        state=("kl_coef",),
        output="advantages",
    ),
    StepSpec("update_actor", 3, "update", "actor", reads=("advantage",), state=("actor",)),
    StepSpec(
        "update_critic",
        3,
        "update",
        "critic",
        reads=("advantage",),
        state=("critic",),
        runs_if=_critic,
        when="with a critic",
    ),
    StepSpec(
        "publish_policy",
        4,
        "publish",
        "actor",
        reads=("update_actor",),
        runs_if=asynchronous,
        when=_ASYNC,
    ),
    StepSpec(
        "evaluate",
        4,
        "evaluate",
        "actor",
        runs_if=_held_out,
        when="every evaluation.every iterations and at a run's end, with data.val_files",
    ),
    StepSpec("commit", 5, "commit"),
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
            raise ValueError(f"step {s.name!r} is declared twice")
        names.add(s.name)
        for up in (*s.reads, *s.gathers):
            if seen.get(up, s.stage) >= s.stage:
                raise ValueError(f"step {s.name!r} reads {up!r}, which is not a step of an earlier stage")
        for name in (s.name, s.provides):
            if name is not None:
                seen[name] = min(seen.get(name, s.stage), s.stage)


_check(STEPS)


def steps(cfg: Any, phases: Iterable[Phase] | None = None) -> list[StepSpec]:
    """The rows that run under ``cfg`` (of ``phases`` only, when given), in table order."""
    wanted = set(phases) if phases is not None else None
    return [s for s in STEPS if s.runs(cfg) and (wanted is None or s.phase in wanted)]


def output_of(step: str) -> str:
    """The name of the Arrow output later steps read from ``step``'s receipt."""
    out = STEP[step].output
    if out is None:
        raise KeyError(f"step {step!r} has no output later steps read")
    return out


def pending_roles(cfg: Any, missing: Callable[[str], bool]) -> list[str]:
    """The worker groups that the unfinished steps of an iteration need (``missing(step)``: no
    receipt yet), in the table's order of roles; evaluation is not counted (it runs on the actor
    group that the update just used)."""
    roles: list[str] = []
    for s in steps(cfg, ("rollout", "score", "update", "publish")):
        if s.role is not None and s.role not in roles and missing(s.name):
            roles.append(s.role)
    return roles


def trained_roles(cfg: Any) -> list[str]:
    """The roles an iteration updates: the ones with checkpoints (``actor``, and ``critic`` with a
    critic), in table order."""
    return [s.role for s in steps(cfg, ("update",)) if s.role is not None]


def actor_group_role(cfg: Any) -> str:
    """What the actor group's worker holds in a training run of ``cfg``, from the steps that run
    on it: always the trained actor; the rollout engine when ``generate`` or ``evaluate`` runs; the
    reference policy when ``ref_log_prob`` runs (a KL term: without one no frozen copy of the model
    is built). One of the worker's roles (``actor_rollout_ref``, ``actor_rollout``, ``actor_ref``,
    ``actor``), with the ``+teacher`` flag when ``teacher_log_prob`` runs (a frozen teacher too)."""
    runs = {s.name for s in steps(cfg) if s.role == "actor"}
    parts = ["actor"]
    if runs & {"generate", "evaluate"}:
        parts.append("rollout")
    if "ref_log_prob" in runs:
        parts.append("ref")
    return "_".join(parts) + ("+teacher" if "teacher_log_prob" in runs else "")


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
