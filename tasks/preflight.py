"""``preflight``: the checks of ``ppoflow.infra.preflight``, as the first task of every run.

It runs after the experiment lock is taken and before the device slots and any worker group: a
run that cannot work fails here in about a second, with one message per problem (the file or
field, what was found, the fix), instead of in ``generate`` after every group and vLLM started.
Its problems are permanent (no retries); a storage hiccup while checking is retried.

The tokenizer it loads is the run's (``RunContext.tokenizer``), so ``generate`` does not load it
again.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from ppoflow.infra.preflight import preflight as run_checks
from ppoflow.tasks.run import get_run
from ppoflow.tasks.step import TASK_OPTIONS, task_logs

__all__ = ["preflight"]


@task(name="preflight", task_run_name="preflight", **TASK_OPTIONS)
def preflight(run: str) -> dict[str, Any]:
    """Check the run's experiment before anything starts; returns ``{passed, notes, seconds}``."""
    ctx = get_run(run)
    with task_logs(ctx) as logger:
        report = run_checks(ctx.cfg, lambda: ctx.inputs.tokenizer)
        for line in report.passed:
            logger.info(f"ok  {line}")
        for note in report.notes:
            logger.warning(f"preflight: {note}")
        logger.info(f"preflight: {len(report.passed)} checks passed in {report.seconds:.2f} s")
    return {"passed": report.passed, "notes": report.notes, "seconds": report.seconds}
