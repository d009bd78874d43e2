"""Environments for the multi-turn tests: scripted answers, per-turn rewards, and tool calls."""

from __future__ import annotations

from typing import Any

from ppoflow.infra.envs import Environment, Reset, StepOutcome, ToolResult

#: A dataset prompt holding a worked example: a python call, its output as a tool message, the
#: answer, then the question the policy is to answer.
WORKED_EXAMPLE = [
    {"role": "user", "content": "What is 3*4?"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "python", "arguments": {"code": "3*4"}}</tool_call>',
    },
    {"role": "tool", "name": "python", "content": "12"},
    {"role": "assistant", "content": "12"},
    {"role": "user", "content": "What is 5*6?"},
]


class ScriptedEnv(Environment):
    """Each row says how many policy turns its episode has (``extra_info["turns"]``, else
    ``1 + index % 3``). Step t
    answers ``obs<t>`` (a user message) with reward ``0.5 * (t + 1)``; the last step ends the
    episode with reward 10. Every turn's text and every reset row are recorded."""

    log: list[tuple[str, Any]] = []

    def __init__(self, settings, reply: str = "obs"):
        super().__init__(settings)
        self.reply, self.t, self.turns = reply, 0, 1

    def reset(self, row: dict[str, Any]) -> Reset:
        info = row["extra_info"]
        self.turns = int(info.get("turns", 1 + info["index"] % 3))
        ScriptedEnv.log.append(("reset", row["extra_info"]["index"]))
        return Reset(messages=[{"role": "user", "content": f"q{row['extra_info']['index']}"}], tools=[])

    def step(self, turn_text: str) -> StepOutcome:
        t, self.t = self.t, self.t + 1
        if t + 1 >= self.turns:
            return StepOutcome(reward=10.0, done=True)
        return StepOutcome(
            messages=[{"role": "user", "content": f"{self.reply}{t}"}],
            reward=0.5 * (t + 1),
            tool_results=[ToolResult("fake", "x", ok=t % 2 == 0)],
        )


def always_error(code: str) -> str:
    """A custom tool that always fails (its error must reach the model as the tool's output)."""
    raise RuntimeError(f"cannot run {code!r}")
