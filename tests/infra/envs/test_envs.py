"""Environments and tools of multi-turn rollouts, without an engine: the sandbox stops what it
must and leaves nothing running; tool calls are parsed and every failure reaches the model as
the tool's output; the chat-template arithmetic appends exactly what a whole conversation would
hold; the registry and the config give clear errors."""

from __future__ import annotations

import json
import os
import tempfile
import time

import psutil
import pytest

from ppoflow.infra.envs import (
    EnvSettings,
    PythonTool,
    ToolEnv,
    build_tool,
    env_class,
    parse_tool_calls,
)
from ppoflow.infra.envs.sandbox import run_python


def _sandbox_processes() -> list[psutil.Process]:
    """Processes of this user whose working directory is a sandbox folder."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if "ppoflow-tool-" in proc.cwd():
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


# ----------------------------------------------------------------------------- the sandbox
def test_sandbox_runs_code_and_prints_the_last_expression():
    assert run_python("x = 6\nprint(x)\nx * 7").output == "6\n42\n"
    res = run_python("import os\nprint(os.listdir('.'), os.environ.get('PYTHONPATH'))")
    assert res.ok and res.output.strip() == "[] None"  # a fresh empty folder, a minimal environment


def test_sandbox_stops_an_endless_loop_and_leaves_nothing_running():
    t0 = time.monotonic()
    res = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert not res.ok and res.timed_out and "longer than 1 s" in res.output
    assert _sandbox_processes() == []


def test_sandbox_stops_an_allocation_over_its_memory_limit():
    res = run_python("x = bytearray(2 * 1024 ** 3)\nlen(x)", memory_mb=256)
    assert not res.ok and "MemoryError" in res.output and "256 MB" in res.output
    assert _sandbox_processes() == []


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import _socket\n_socket.socket()",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
    ],
)
def test_sandbox_refuses_the_network_and_new_processes(code):
    res = run_python(code)
    assert not res.ok and "not allowed" in res.output, res.output


def test_sandbox_reports_the_code_s_own_error():
    res = run_python("1 / 0")
    assert not res.ok and res.output == "Error: ZeroDivisionError: division by zero"


# ----------------------------------------------------------------------------- tool calls
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


# ----------------------------------------------------------------------------- registry and config
def test_environment_names_and_import_paths(tmp_path):
    assert env_class("tools") is ToolEnv
    assert env_class("tests.support.multiturn_envs:ScriptedEnv").__name__ == "ScriptedEnv"
    f = tmp_path / "my_env.py"
    f.write_text("from ppoflow.infra.envs import ToolEnv\nclass Mine(ToolEnv):\n    pass\nnot_env = 3\n")
    assert env_class(f"{f}:Mine").__name__ == "Mine"
    with pytest.raises(KeyError, match="not registered.*register_env"):
        env_class("nope")
    with pytest.raises(TypeError, match="not a subclass of ppoflow.infra.envs.Environment"):
        env_class(f"{f}:not_env")
    with pytest.raises(KeyError, match="no tool 'calc'.*register_tool"):
        build_tool("calc")
    # import paths go through the one loader: its errors name the setting and the fix
    with pytest.raises(
        ImportError, match=r"^rollout.multi_turn.environment='no_such_mod:Env': cannot import"
    ):
        env_class("no_such_mod:Env")
    with pytest.raises(
        ValueError, match=r"^rollout.multi_turn.tools='my-tools:calc': .*'path/to/file.py:name'"
    ):
        build_tool("my-tools:calc")


def test_multi_turn_config_errors():
    from pydantic import ValidationError

    from ppoflow.infra.config import RolloutConfig

    with pytest.raises(ValidationError, match="tensor_model_parallel_size=1"):
        RolloutConfig(tensor_model_parallel_size=2, multi_turn={"enable": True})
    with pytest.raises(ValidationError, match="max_turn_tokens=64 exceeds the episode budget"):
        RolloutConfig(response_length=32, multi_turn={"enable": True, "max_turn_tokens": 64})
    with pytest.raises(ValidationError, match="max_turns"):
        RolloutConfig(multi_turn={"enable": True, "max_turns": 0})


# ----------------------------------------------------------------------------- chat-template arithmetic
HERMES_TEMPLATE = (  # Qwen2.5's shape of tool prompting, cut down
    "{% if tools %}<|system|>Tools:{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "Call with <tool_call>{json}</tool_call><|endoftext|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}"
    "</tool_response><|endoftext|>{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|endoftext|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def char_tokenizer():
    from ppoflow.demo.tiny_models import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.parametrize("mode", ["template", "tag"])
def test_appended_tokens_complete_the_whole_conversation(char_tokenizer, mode):
    """Prompt + policy turns (as sampled, stop token included or cut) + environment tokens equal
    the tokens of the whole conversation rendered by the template at once."""
    from ppoflow.workers.rollout.chat_turns import ChatFormat

    tok = char_tokenizer
    tok.chat_template = HERMES_TEMPLATE
    try:
        fmt = ChatFormat(tok, "auto" if mode == "template" else "tag")
        assert fmt.mode == mode
        schemas = [PythonTool().schema()]
        first = [{"role": "user", "content": "What is 3*4?"}]
        a1 = '<tool_call>{"name": "python", "arguments": {"code": "3*4"}}</tool_call>'
        tool = [{"role": "tool", "name": "python", "content": "12"}]
        eos = tok.encode("<|endoftext|>", add_special_tokens=False)
        turn1 = tok.encode(a1, add_special_tokens=False) + eos  # stopped on its own
        turn2 = tok.encode("It is 12", add_special_tokens=False)  # cut at the token limit
        tokens = fmt.prompt_tokens(first, schemas) + turn1 + fmt.env_tokens(turn1, tool, schemas) + turn2
        conversation = [*first, {"role": "assistant", "content": a1}, *tool]
        if mode == "tag":
            conversation = fmt._with_tag_system(conversation, schemas)
            conversation[-1] = {"role": "user", "content": "<tool_response>\n12\n</tool_response>"}
        whole = tok.apply_chat_template(
            conversation,
            tools=schemas if mode == "template" else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tokens == tok.encode(whole, add_special_tokens=False) + turn2
        if mode == "template":
            assert "Tools:" in whole and json.dumps(schemas[0])[:20] in whole
        else:
            assert "<tool_call>" in whole and "Tools:\n{" in whole
        # a turn cut before its stop token gets the whole close from the environment
        closed = fmt.env_tokens(turn2, tool, schemas)
        assert closed[: len(eos)] == eos
    finally:
        from ppoflow.demo.tiny_models import CHAT_TEMPLATE

        tok.chat_template = CHAT_TEMPLATE


def test_a_prompt_with_a_worked_example_renders_tool_outputs_as_the_environment_does(char_tokenizer):
    """Tag mode on a template that knows no tool role: a tool message in the dataset's prompt (a
    demonstration of a call and its output) becomes the same ``<tool_response>`` user message the
    environment's outputs become, not a message of an unknown role."""
    from ppoflow.workers.rollout.chat_turns import ChatFormat

    tok = char_tokenizer
    fmt = ChatFormat(tok, "tag")
    schemas = [PythonTool().schema()]
    call = '<tool_call>{"name": "python", "arguments": {"code": "3*4"}}</tool_call>'
    prompt = [
        {"role": "user", "content": "What is 3*4?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "name": "python", "content": "12"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "What is 5*6?"},
    ]
    expected = fmt._with_tag_system(prompt, schemas)
    expected[3] = {"role": "user", "content": "<tool_response>\n12\n</tool_response>"}
    whole = tok.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert fmt.prompt_tokens(prompt, schemas) == tok.encode(whole, add_special_tokens=False)
    assert "<|tool|>" not in tok.decode(fmt.prompt_tokens(prompt, schemas))
    # a parquet column of messages gives each message every field; the unset ones are dropped
    from ppoflow.infra.envs.tool_env import row_messages

    stored = [{"role": m["role"], "content": m["content"], "name": m.get("name")} for m in prompt]
    assert row_messages({"raw_prompt": stored}) == prompt


def test_template_mode_needs_a_tool_format(char_tokenizer):
    from ppoflow.workers.rollout.chat_turns import ChatFormat

    with pytest.raises(ValueError, match="no <tool_call> tool format: use 'tag'"):
        ChatFormat(char_tokenizer, "template")
    assert ChatFormat(char_tokenizer, "auto").mode == "tag"


def test_nothing_left_behind():
    assert _sandbox_processes() == []
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("ppoflow-tool-")]


def test_examples_parse_and_the_guessing_environment_rewards_each_turn():
    from ppoflow.infra.config import load_config
    from tests.support.paths import ROOT

    for name in ("gpu.yaml", "cpu.yaml"):
        cfg = load_config(os.path.join(ROOT, "examples", "multiturn", name))
        assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tools == ["python"]
    path = os.path.join(ROOT, "examples", "multiturn", "guess_env.py")
    cls = env_class(f"{path}:GuessEnv")
    env = cls(EnvSettings(tools=(build_tool(f"{path}:hint"),)), wrong_guess_reward=-0.2)
    env.reset({"ground_truth": "42"})
    out = env.step('<tool_call>{"name": "hint", "arguments": {"number": "1"}}</tool_call>')
    assert out.messages[0]["content"] == "even" and out.reward == 0.0 and not out.done
    out = env.step("50")
    assert (out.messages[0]["content"], out.reward, out.done) == ("lower", -0.2, False)
    out = env.step("It is 42")
    assert (out.reward, out.done) == (1.0, True)
