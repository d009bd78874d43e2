"""Preflight: check an experiment before any worker group starts, and report every problem at once.

    report = preflight(cfg, load_tokenizer)     # PreflightError listing each problem, else a report

``checks`` runs the checks of storage, models and checkpoints (``disk``: room for the snapshots);
``resources`` those of what this machine can hold of the run's ranks, with the memory plan:
``model_shape`` (a model's sizes from its ``config.json``), ``memory_plan`` (what each group holds
per rank and stage; ``memory_engine`` the rollout engine's part), ``memory_fixes`` (the plan again
after each fix), ``memory_check`` (the plan against the GPUs, the refusal, ``auto`` token budgets);
``data`` those of the data files (training and held-out) and the reward function (a sample, not a
pass); ``teacher`` that a distillation teacher shares the student's tokenizer; ``report`` is what
they report.
"""

from ppoflow.infra.preflight.checks import checkpoint_problem, preflight, rollback_hint
from ppoflow.infra.preflight.report import Checks, PreflightError, PreflightReport, Problem

__all__ = [
    "preflight",
    "Problem",
    "PreflightError",
    "PreflightReport",
    "checkpoint_problem",
    "rollback_hint",
    "Checks",
]
