"""``openenv``: an OpenEnv environment server as a multi-turn environment.

    rollout:
      multi_turn:
        enable: true
        environment: openenv
        tools: []
        env_kwargs: {base_url: "http://127.0.0.1:8000", action_field: message}

OpenEnv (``openenv-core``, ``pip install 'ppoflow[openenv]'``) serves an environment over HTTP:
a session is a WebSocket (``/ws``) on which the client sends ``reset`` and ``step`` messages and
gets ``{observation, reward, done}`` back (its ``POST /reset`` and ``/step`` routes build a fresh
environment per call, so an episode of several turns needs the session). Each episode of a
rollout opens its own session with OpenEnv's ``GenericEnvClient`` (plain dicts, so nothing of the
environment's own package is installed or run here), and closes it when the episode ends. The
server must allow as many concurrent sessions as a rank runs episodes
(``create_app(..., max_concurrent_envs=N)`` with ``SUPPORTS_CONCURRENT_SESSIONS = True``).

An episode: ``reset`` (with the keyword arguments ``reset_kwargs`` gives and ``reset_from_row``
takes from the row's ``extra_info``), whose observation becomes the first user message after the dataset's
prompt (``prompt``: ``both``, the default), or the only one (``observation``), or is dropped
(``row``); then every policy turn is the action ``{action_field: <turn text>, **action_extra}``;
the step's reward lands on the turn, ``done`` ends the episode, and otherwise its observation is
the next message (role ``observation_role``). What of an observation is shown: its
``observation_field`` when given, else its only field besides ``done``/``reward``/``metadata``,
else those fields as JSON.

env_kwargs: ``base_url`` (required), ``action_field`` ("message"), ``action_extra`` ({}),
``observation_field`` (None), ``observation_role`` ("user"), ``prompt`` ("both"),
``reset_kwargs`` ({}), ``reset_from_row`` ({reset argument: extra_info key}),
``connect_timeout_s`` (10), ``message_timeout_s`` (60).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from ppoflow.infra.envs.base import Environment, EnvSettings, Reset, StepOutcome, register_env
from ppoflow.infra.envs.tool_env import row_messages

__all__ = ["OpenEnvEnvironment", "observation_text"]

EXTRA = "pip install 'ppoflow[openenv]' (openenv-core==0.3.0)"
_NOT_SHOWN = ("done", "reward", "metadata")


def observation_text(observation: Any, field: str | None = None) -> str:
    """What the policy reads of an observation (see the module docstring)."""
    if not isinstance(observation, dict):
        return str(observation)
    if field is not None:
        if field not in observation:
            raise KeyError(
                f"the observation has no field {field!r} (fields: {', '.join(sorted(observation))}); "
                "set rollout.multi_turn.env_kwargs.observation_field to one of them"
            )
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value)
    shown = {k: v for k, v in observation.items() if k not in _NOT_SHOWN}
    if len(shown) == 1:
        (value,) = shown.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(shown, sort_keys=True)


def _client(base_url: str, connect_timeout_s: float, message_timeout_s: float) -> Any:
    try:
        from openenv.core import GenericEnvClient
    except ImportError as exc:
        raise ImportError(f"rollout.multi_turn.environment=openenv needs openenv-core: {EXTRA}") from exc
    return GenericEnvClient(
        base_url=base_url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
    ).sync()


@register_env("openenv")
class OpenEnvEnvironment(Environment):
    """One episode on an OpenEnv server (see the module docstring)."""

    def __init__(
        self,
        settings: EnvSettings,
        base_url: str | None = None,
        action_field: str = "message",
        action_extra: dict[str, Any] | None = None,
        observation_field: str | None = None,
        observation_role: Literal["user", "tool"] = "user",
        prompt: Literal["both", "observation", "row"] = "both",
        reset_kwargs: dict[str, Any] | None = None,
        reset_from_row: dict[str, str] | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
    ):
        super().__init__(settings)
        if not base_url:
            raise ValueError(
                "rollout.multi_turn.env_kwargs.base_url is missing: the OpenEnv server's http://host:port"
            )
        if prompt not in ("both", "observation", "row"):
            raise ValueError(
                f"rollout.multi_turn.env_kwargs.prompt={prompt!r}: one of both, observation, row"
            )
        self.base_url = base_url
        self.action_field, self.action_extra = action_field, dict(action_extra or {})
        self.observation_field, self.role = observation_field, observation_role
        self.prompt = prompt
        self.reset_kwargs, self.reset_from_row = dict(reset_kwargs or {}), dict(reset_from_row or {})
        self.timeouts = (float(connect_timeout_s), float(message_timeout_s))
        self.client: Any = None

    def _reset_args(self, row: dict[str, Any]) -> dict[str, Any]:
        info = row.get("extra_info")
        extra: dict[str, Any] = info if isinstance(info, dict) else {}
        args = dict(self.reset_kwargs)
        for name, key in self.reset_from_row.items():
            if key not in extra:
                raise KeyError(
                    f"rollout.multi_turn.env_kwargs.reset_from_row names extra_info[{key!r}], which the "
                    f"row does not have (it has: {', '.join(sorted(extra)) or 'no extra_info'})"
                )
            args[name] = extra[key]
        return args

    def reset(self, row: dict[str, Any]) -> Reset:
        self.client = _client(self.base_url, *self.timeouts)
        try:
            self.client.connect()
            result = self.client.reset(**self._reset_args(row))
        except (OSError, TimeoutError, ConnectionError) as exc:
            raise ConnectionError(
                f"OpenEnv server {self.base_url} (rollout.multi_turn.env_kwargs.base_url): "
                f"{type(exc).__name__}: {exc}; is it running, and does it allow a session per episode "
                "(max_concurrent_envs)?"
            ) from exc
        shown = observation_text(result.observation, self.observation_field)
        if self.prompt == "row":
            return Reset(messages=row_messages(row))
        first = [{"role": "user", "content": shown}]
        return Reset(messages=first if self.prompt == "observation" else row_messages(row) + first)

    def step(self, turn_text: str) -> StepOutcome:
        result = self.client.step({**self.action_extra, self.action_field: turn_text})
        reward = float(result.reward or 0.0)
        if result.done:
            return StepOutcome(reward=reward, done=True)
        content = observation_text(result.observation, self.observation_field)
        return StepOutcome(messages=[{"role": self.role, "content": content}], reward=reward)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
