"""Environments and tools of multi-turn rollouts (docs/multiturn.md).

- :mod:`~ppoflow.infra.envs.base`: ``Environment`` (``reset(row)``, ``step(turn_text)``), its
  registry (``register_env``, ``env_class``);
- :mod:`~ppoflow.infra.envs.tools`: ``Tool``, ``register_tool``, ``build_tool``, the tool-call
  parser, the built-in ``python`` tool;
- :mod:`~ppoflow.infra.envs.sandbox`: the subprocess sandbox the ``python`` tool runs in;
- :mod:`~ppoflow.infra.envs.tool_env`: ``tools``, the built-in tool-use environment;
- :mod:`~ppoflow.infra.envs.openenv`: ``openenv``, an OpenEnv environment server (reset/step in
  a session over HTTP), with the ``openenv`` extra.
"""

from ppoflow.infra.envs.base import (
    Environment,
    EnvSettings,
    Reset,
    StepOutcome,
    env_class,
    known_envs,
    register_env,
)
from ppoflow.infra.envs.openenv import OpenEnvEnvironment
from ppoflow.infra.envs.tool_env import ToolEnv
from ppoflow.infra.envs.tools import (
    FunctionTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolResult,
    build_tool,
    known_tools,
    parse_tool_calls,
    register_tool,
)

__all__ = [
    "Environment",
    "EnvSettings",
    "Reset",
    "StepOutcome",
    "env_class",
    "known_envs",
    "register_env",
    "ToolEnv",
    "OpenEnvEnvironment",
    "FunctionTool",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolResult",
    "build_tool",
    "known_tools",
    "parse_tool_calls",
    "register_tool",
]
