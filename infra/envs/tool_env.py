"""``tools``: the built-in tool-use environment.

The dataset's prompt starts the episode with the configured tools on offer. Each policy turn with
``<tool_call>`` calls gets the tools' outputs back (one ``tool`` message per call: an ``Error: ...``
text for an unknown tool, bad arguments, a failure or a timeout); a turn without a call is the
answer, and ends the episode with the run's reward function applied to it (``reward.custom_function``,
else the rule registered for the row's ``data_source``, as for single-turn rollouts), through
:func:`ppoflow.infra.rewards.score_answer`. An episode that reaches the turn limit, or the token
budget, while still calling tools has given no answer: it scores 0.

env_kwargs: ``max_calls_per_turn`` (default 4; further calls get an error).
"""

from __future__ import annotations

from typing import Any

from ppoflow.infra.envs.base import Environment, EnvSettings, Reset, StepOutcome, register_env
from ppoflow.infra.envs.tools import ToolResult, parse_tool_calls
from ppoflow.infra.rewards import score_answer

__all__ = ["ToolEnv", "row_messages"]


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a dataset row's ``raw_prompt`` (a string is one user message). A
    parquet column of messages gives every message every field: the unset ones (None) are dropped."""
    raw = row.get("raw_prompt")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if raw is None:
        raise KeyError(
            "the row has no raw_prompt column: the tools environment starts from the dataset's prompt"
        )
    return [{k: v for k, v in dict(m).items() if v is not None} for m in raw]


@register_env("tools")
class ToolEnv(Environment):
    def __init__(self, settings: EnvSettings, max_calls_per_turn: int = 4):
        super().__init__(settings)
        self.max_calls = int(max_calls_per_turn)
        self.tools = {t.name: t for t in settings.tools}
        self.row: dict[str, Any] = {}

    def reset(self, row: dict[str, Any]) -> Reset:
        self.row = row
        return Reset(messages=row_messages(row), tools=list(self.settings.tools))

    def step(self, turn_text: str) -> StepOutcome:
        calls = parse_tool_calls(turn_text)
        if not calls:
            return StepOutcome(
                reward=score_answer(self.row, turn_text, self.settings.reward_function), done=True
            )
        results = []
        for i, call in enumerate(calls):
            tool = self.tools.get(call.name)
            if i >= self.max_calls:
                res = ToolResult(
                    call.name or "?", f"Error: at most {self.max_calls} tool calls per turn", False
                )
            elif call.error is not None:
                res = ToolResult(call.name or "?", f"Error: {call.error}", False)
            elif tool is None:
                res = ToolResult(
                    call.name, f"Error: no tool {call.name!r}; tools: {', '.join(self.tools)}", False
                )
            else:
                res = tool.call(call.arguments)
            results.append(res)
        messages = [{"role": "tool", "name": r.name, "content": r.output} for r in results]
        return StepOutcome(messages=messages, reward=0.0, done=False, tool_results=results)
