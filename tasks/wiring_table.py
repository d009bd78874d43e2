"""The iteration's wiring as one table, derived from :data:`ppoflow.tasks.graph.STEPS`.

:func:`ppoflow.tasks.graph.picture` shows the order (stages, and when a step runs);
:func:`wiring_table` shows, for every row, the worker group it runs on, what its task reads
(the receipts of earlier steps, the receipts it gathers, the fields of the iteration's start), the
Arrow output later steps read from its receipt, and where the schedule places it. Both are
derived from the rows, so docs/internals.md can show them and a test keeps the page equal to the
code (``tests/tasks/test_wiring_table.py``).
"""

from __future__ import annotations

from ppoflow.tasks.graph import STEPS, StepSpec

__all__ = ["wiring_table"]

#: How the schedule places the steps of a phase (flows/schedule.py).
PLACEMENT = {
    "rollout": "every iteration",
    "score": "every iteration",
    "update": "every iteration",
    "publish": "every iteration, after the updates",
    "evaluate": "every evaluation.every iterations",
    "commit": "pipelined, in order",
}


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else ""


def _row(step: StepSpec) -> str:
    writes = f"`{step.output}`" if step.output else ""
    if step.provides:
        writes += f" (read as `{step.provides}`)"
    placed = PLACEMENT[step.phase] + (f"; at a run's start with `{step.at_start}`" if step.at_start else "")
    cells = [
        str(step.stage),
        f"`{step.name}`",
        f"`{step.role}`" if step.role else "(the flow)",
        _names(step.reads),
        _names(step.gathers),
        _names(step.state),
        writes,
        placed,
    ]
    return "| " + " | ".join(cells) + " |"


def wiring_table() -> str:
    """Every row of the table as a markdown table: its stage (the steps of a stage run side by
    side), step, group, reads, gathers, the start's fields, the Arrow output later steps read
    from its receipt, its placement."""
    head = [
        "| stage | step | group | reads | gathers | start's fields | output later steps read | placed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + [_row(step) for step in STEPS])
