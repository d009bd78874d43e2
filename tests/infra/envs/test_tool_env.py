"""``tools``, the built-in tool-use environment: it runs the turn's tool calls, answers each (a
failure as its error), and scores the final answer with the data source's rule or the run's
custom reward."""

from __future__ import annotations

from ppoflow.infra.envs import EnvSettings, ToolEnv, build_tool
from ppoflow.infra.envs.tool_env import row_messages
from tests.support.multiturn_envs import WORKED_EXAMPLE


def test_tool_env_runs_calls_and_scores_the_answer():
    env = ToolEnv(EnvSettings(tools=(build_tool("python"),), reward_function=None))
    row = {
        "raw_prompt": [{"role": "user", "content": "What is 12 * 34?"}],
        "data_source": "openai/gsm8k",
        "ground_truth": "408",
        "extra_info": None,
    }
    reset = env.reset(row)
    assert reset.messages == row["raw_prompt"] and [t.name for t in reset.tools] == ["python"]
    call = '<tool_call>{"name": "python", "arguments": {"code": "12 * 34"}}</tool_call>'
    bad = '<tool_call>{"name": "shell", "arguments": {}}</tool_call>'
    out = env.step(call + bad)
    assert not out.done and out.reward == 0.0
    assert [m["content"] for m in out.messages] == ["408", "Error: no tool 'shell'; tools: python"]
    assert [(r.name, r.ok) for r in out.tool_results] == [("python", True), ("shell", False)]
    end = env.step("The answer is #### 408")
    assert end.done and end.reward == 1.0 and end.messages == []
    assert env.step("#### 7").reward == 0.0
    # the run's custom reward, when it has one, scores the answer instead of the data source's rule
    custom = ToolEnv(EnvSettings(reward_function="tests.support.rewards:digit_share"))
    custom.reset(row)
    assert custom.step("12ab").reward == 0.5


def test_a_stored_prompt_s_messages_drop_the_fields_they_do_not_set():
    """A parquet column of messages gives each message every field; the unset ones are dropped."""
    prompt = [dict(m) for m in WORKED_EXAMPLE]
    stored = [{"role": m["role"], "content": m["content"], "name": m.get("name")} for m in prompt]
    assert row_messages({"raw_prompt": stored}) == prompt
