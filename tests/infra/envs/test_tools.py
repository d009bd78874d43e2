"""Tools of multi-turn rollouts: tool calls parsed from the policy's text (every malformed call
named), every failure reaching the model as the tool's output, tools by name or import path."""

from __future__ import annotations

import pytest

from ppoflow.infra.envs import PythonTool, build_tool, parse_tool_calls


def test_parse_tool_calls():
    text = (
        'I will compute. <tool_call>{"name": "python", "arguments": {"code": "1+1"}}</tool_call>'
        '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"2\\"}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "python", "arguments": 3}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("python", {"code": "1+1"}, True),
        ("python", {"code": "2"}, True),
    ]
    assert "not valid JSON" in calls[2].error
    assert '{"name": <tool>' in calls[3].error
    assert "must be a JSON object" in calls[4].error
    assert parse_tool_calls("no call here") == []
    unclosed = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "2*3"}} and more')
    assert [(c.name, c.arguments) for c in unclosed] == [("python", {"code": "2*3"})]


def test_a_failing_tool_answers_with_its_error():
    tool = build_tool("tests.support.multiturn_envs:always_error")
    res = tool.call({"code": "x"})
    assert not res.ok and res.output == "Error: RuntimeError: cannot run 'x'"
    res = tool.call({})
    assert not res.ok and "needs the arguments ['code']" in res.output
    python = build_tool("python", timeout_s=1.0)
    assert isinstance(python, PythonTool) and python.timeout_s == 1.0
    assert python.call({"code": "17 * 3"}).output == "51"
    assert python.call({"code": 17}).output == "Error: python needs a 'code' string"


def test_tool_names_and_import_paths():
    with pytest.raises(KeyError, match="no tool 'calc'.*register_tool"):
        build_tool("calc")
    # import paths go through the one loader: its errors name the setting and the fix
    with pytest.raises(
        ValueError, match=r"^rollout.multi_turn.tools='my-tools:calc': .*'path/to/file.py:name'"
    ):
        build_tool("my-tools:calc")
