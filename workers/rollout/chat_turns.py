"""Chat-template arithmetic of multi-turn episodes: the first prompt's tokens with the tools on
offer, and the tokens that follow a policy turn (the template's delimiters around the
environment's messages, up to the next assistant header), tokenizing only the appended text.

The policy's own tokens are never re-tokenized. After a turn, the template's close of an
assistant message (e.g. ChatML's ``<|im_end|>\\n``) is completed: the part the policy already
sampled (its stop token) is not repeated; a turn cut at the token limit gets the whole close.
The appended text is rendered as ``template(base + messages, add_generation_prompt=True)``
minus ``template(base)``, with ``base`` a fixed user/assistant exchange: the same delimiters a
whole conversation would have there.

Tool formats: ``template`` passes the tools to ``apply_chat_template(tools=...)`` and sends tool
outputs as ``tool`` messages (Qwen2/Hermes templates render them as ``<tool_response>``);
``tag`` (the fallback for templates without a tool format) describes the tools and the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` tag in a system message and sends tool
outputs as a user message of ``<tool_response>...</tool_response>`` blocks.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ChatFormat", "template_has_tool_format", "TAG_INSTRUCTIONS"]

_PLACEHOLDER = "PPOFLOW_TURN_PLACEHOLDER"

TAG_INSTRUCTIONS = (
    "You may call tools. To call one, write\n"
    '<tool_call>{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}</tool_call>\n'
    "and stop; its output comes back in <tool_response></tool_response>. When you have the "
    "answer, reply without a tool call.\nTools:\n{tools}"
)


def template_has_tool_format(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools and speaks ``<tool_call>``."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<tool_call>" not in template:
        return False
    schema = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {}}}
    msgs = [{"role": "user", "content": "x"}]
    try:
        with_tools = tokenizer.apply_chat_template(msgs, tools=[schema], tokenize=False)
        without = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render tools has no tool format
        return False
    return bool(with_tools != without)


class ChatFormat:
    """Renders one batch's prompts and environment turns (``mode``: ``template`` or ``tag``)."""

    def __init__(self, tokenizer: Any, mode: str):
        if mode == "auto":
            mode = "template" if template_has_tool_format(tokenizer) else "tag"
        if mode == "template" and not template_has_tool_format(tokenizer):
            raise ValueError(
                "rollout.multi_turn.tool_format='template', but the tokenizer's chat template has no "
                "<tool_call> tool format: use 'tag' (or 'auto')"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template")
        self.tokenizer, self.mode = tokenizer, mode
        self._cache: dict[str, tuple[str, str]] = {}

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], schemas: list[dict] | None, generation: bool) -> str:
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": generation}
        if schemas and self.mode == "template":
            kwargs["tools"] = schemas
        return str(self.tokenizer.apply_chat_template(messages, **kwargs))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _with_tag_system(self, messages: list[dict[str, Any]], schemas: list[dict]) -> list[dict[str, Any]]:
        if self.mode != "tag" or not schemas:
            return messages
        text = TAG_INSTRUCTIONS.format(tools="\n".join(json.dumps(s["function"]) for s in schemas))
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _as_chat(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tag mode: consecutive tool messages become one user message of ``<tool_response>`` blocks."""
        if self.mode != "tag":
            return messages
        out: list[dict[str, Any]] = []
        for m in messages:
            if m.get("role") != "tool":
                out.append(m)
                continue
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        return [{k: v for k, v in m.items() if k != "_tool"} for m in out]

    def prompt_tokens(self, messages: list[dict[str, Any]], schemas: list[dict]) -> list[int]:
        """The first prompt, ending with the assistant header. Tool messages in it (a worked
        example, an earlier exchange) render as the environment's tool outputs do."""
        return self._encode(
            self._render(self._with_tag_system(self._as_chat(messages), schemas), schemas, True)
        )

    def _base(self, schemas: list[dict]) -> tuple[str, str]:
        """(the base exchange rendered, the close of its assistant message) for these tools."""
        key = json.dumps(schemas, sort_keys=True)
        if key not in self._cache:
            base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PLACEHOLDER}]
            text = self._render(self._with_tag_system(base, schemas), schemas, False)
            cut = text.rfind(_PLACEHOLDER)
            if cut < 0:
                raise ValueError("the chat template does not render an assistant message's content")
            self._cache[key] = (text, text[cut + len(_PLACEHOLDER) :])
        return self._cache[key]

    def env_tokens(
        self, turn_tokens: list[int], messages: list[dict[str, Any]], schemas: list[dict]
    ) -> list[int]:
        """The tokens after a policy turn: the rest of the assistant close, the environment's
        ``messages`` in the template's delimiters, the next assistant header."""
        base_text, close = self._base(schemas)
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _PLACEHOLDER}]
        full = self._render(self._with_tag_system(base, schemas) + self._as_chat(messages), schemas, True)
        if not full.startswith(base_text):
            raise ValueError(
                "the chat template renders earlier messages differently once more follow; multi-turn "
                "rollouts need a template that only appends"
            )
        rest = close
        if turn_tokens:
            stop = self.tokenizer.decode(turn_tokens[-1:], skip_special_tokens=False)
            if stop and close.startswith(stop):
                rest = close[len(stop) :]
        return self._encode(rest + full[len(base_text) :])
