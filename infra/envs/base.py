"""The environment interface of multi-turn rollouts and its registry.

    @register_env("my_env")
    class MyEnv(Environment):
        def reset(self, row) -> Reset: ...          # the first messages, the tools on offer
        def step(self, turn_text) -> StepOutcome: ... # tool output / reply, reward, done

One environment object lives for one episode: the rollout builds it with
``cls(settings, **rollout.multi_turn.env_kwargs)``, calls ``reset`` with the dataset row (its
non-tensor columns: ``raw_prompt``, ``ground_truth``, ``data_source``, ``extra_info``, ...), then
``step`` with the text of each policy turn (special tokens removed). ``StepOutcome.messages`` are
chat messages (role ``tool`` for tool outputs, ``user`` for replies) appended after the turn with
the chat template's delimiters; ``reward`` lands on the last token of that policy turn (a final
``done`` step's reward is the episode reward); ``done`` ends the episode. The rollout also ends it
after ``max_turns`` policy turns or when the token budget is spent; the last step's reward
counts then too (its messages are dropped).

Environments are named in ``rollout.multi_turn.environment`` by registered name (built in:
``tools``, :class:`ToolEnv`) or import path ``package.module:Class`` / ``path/to/file.py:Class``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppoflow.infra.envs.tools import Tool, ToolResult
from ppoflow.infra.plugins.loader import load_object

__all__ = ["Environment", "EnvSettings", "Reset", "StepOutcome", "register_env", "env_class", "known_envs"]

_ENVS: dict[str, type[Environment]] = {}


@dataclass(frozen=True)
class EnvSettings:
    """What the rollout hands every environment: the tools of ``rollout.multi_turn.tools`` and
    the reward function the rest of the run uses (``reward.custom_function``; None = the rule
    registered for the row's ``data_source``)."""

    tools: tuple[Tool, ...] = ()
    reward_function: str | None = None
    max_turns: int = 4


@dataclass
class Reset:
    """The start of an episode: ``messages`` (None: the dataset's prompt as tokenized) and the
    ``tools`` offered (shown to the policy through the chat template or the fallback tag)."""

    messages: list[dict[str, Any]] | None = None
    tools: list[Tool] = field(default_factory=list)


@dataclass
class StepOutcome:
    """What the environment answers to one policy turn (see the module docstring)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    tool_results: list[ToolResult] = field(default_factory=list)


class Environment:
    """Base class: keeps ``settings``; subclasses implement ``reset`` and ``step``."""

    def __init__(self, settings: EnvSettings, **kwargs: Any):
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} takes no env_kwargs {sorted(kwargs)} (rollout.multi_turn.env_kwargs)"
            )
        self.settings = settings

    def reset(self, row: dict[str, Any]) -> Reset:
        raise NotImplementedError

    def step(self, turn_text: str) -> StepOutcome:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (called once, after its last step)."""


def register_env(name: str, *, override: bool = False) -> Callable[[type[Environment]], type[Environment]]:
    """Decorator: make an ``Environment`` subclass available as ``rollout.multi_turn.environment=name``."""

    def deco(cls: type[Environment]) -> type[Environment]:
        old = _ENVS.get(name)
        if old is not None and old is not cls and not override:
            raise ValueError(f"an environment is already registered as {name!r}; pass override=True")
        _ENVS[name] = cls
        return cls

    return deco


def known_envs() -> list[str]:
    return sorted(_ENVS)


def env_class(spec: str) -> type[Environment]:
    """The class ``rollout.multi_turn.environment`` names (registered name or import path)."""
    cls = _ENVS.get(spec)
    if cls is None:
        if ":" not in spec:
            raise KeyError(
                f"rollout.multi_turn.environment={spec!r} is not registered (known: "
                f"{', '.join(known_envs())}); register it with @ppoflow.infra.envs.register_env or "
                "write 'package.module:Class'"
            )
        cls = load_object(spec, "rollout.multi_turn.environment", "Class")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(
            f"rollout.multi_turn.environment={spec!r} is {cls!r}, not a subclass of "
            "ppoflow.infra.envs.Environment"
        )
    return cls
