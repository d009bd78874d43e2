"""Chat-template arithmetic of multi-turn episodes (``chat_turns``), without an engine: the tokens
appended after each turn complete exactly the tokens of the whole conversation rendered at once,
in both tool formats (the template's own and the ``<tool_call>`` tag), and a template without a
tool format is told which to use."""

from __future__ import annotations

import json

import pytest

from ppoflow.infra.envs import PythonTool
from ppoflow.workers.rollout.chat_turns import ChatFormat
from tests.support.multiturn_envs import WORKED_EXAMPLE

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
    environment's outputs become, not a message of an unknown role. (How such a prompt's stored
    messages are read: tests/infra/envs/test_tool_env.py.)"""
    tok = char_tokenizer
    fmt = ChatFormat(tok, "tag")
    schemas = [PythonTool().schema()]
    prompt = [dict(m) for m in WORKED_EXAMPLE]
    expected = fmt._with_tag_system(prompt, schemas)
    expected[3] = {"role": "user", "content": "<tool_response>\n12\n</tool_response>"}
    whole = tok.apply_chat_template(expected, tokenize=False, add_generation_prompt=True)
    assert fmt.prompt_tokens(prompt, schemas) == tok.encode(whole, add_special_tokens=False)
    assert "<|tool|>" not in tok.decode(fmt.prompt_tokens(prompt, schemas))


def test_template_mode_needs_a_tool_format(char_tokenizer):
    with pytest.raises(ValueError, match="no <tool_call> tool format: use 'tag'"):
        ChatFormat(char_tokenizer, "template")
    assert ChatFormat(char_tokenizer, "auto").mode == "tag"
