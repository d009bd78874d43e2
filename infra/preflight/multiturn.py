"""Preflight of ``rollout.multi_turn``: the environment class and every tool load (an import
error here costs a second, not the start of the worker groups and vLLM)."""

from __future__ import annotations

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.preflight.report import Checks

__all__ = ["check_multi_turn"]


def check_multi_turn(cfg: ExperimentConfig, c: Checks) -> None:
    """Each problem of ``rollout.multi_turn`` (environment, tools) into ``c``."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return
    from ppoflow.infra.envs import build_tool, env_class

    try:
        env_class(mt.environment)
    except Exception as exc:  # noqa: BLE001 - ImportError, KeyError, TypeError ... all mean the same here
        c.problem(
            f"rollout.multi_turn.environment={mt.environment!r}",
            f"{type(exc).__name__}: {exc}",
            "name a registered environment ('tools') or 'package.module:Class' / 'path/to/file.py:Class'",
        )
    for name in mt.tools:
        try:
            build_tool(name)
        except Exception as exc:  # noqa: BLE001 - as above
            c.problem(
                f"rollout.multi_turn.tools: {name!r}",
                f"{type(exc).__name__}: {exc}",
                "name a registered tool ('python') or 'package.module:name' / 'path/to/file.py:name'",
            )
    if not c.problems:
        c.ok(f"multi-turn: environment {mt.environment!r}, tools {mt.tools}")
