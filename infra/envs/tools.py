"""Tools a policy may call in a multi-turn episode, their registry, and the tool-call format.

    @register_tool("lookup")
    class Lookup(Tool):
        description = "Look a word up"
        parameters = {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}
        def run(self, arguments: dict) -> str: ...

A tool is named in ``rollout.multi_turn.tools`` by its registered name or an import path
(``package.module:name`` / ``path/to/file.py:name``, a ``Tool`` subclass or instance, or a plain
function whose docstring is the description and which takes keyword arguments). ``call`` never
raises: a tool that fails, or is called with arguments it does not take, gives the model an
``Error: ...`` text as its output. A plain-function tool runs in the rank's own process (no
limits); ``python`` runs in the sandbox of ``ppoflow.infra.envs.sandbox``.

Tool calls are read in the Hermes / Qwen2 format, the one Qwen's chat templates teach:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several per turn allowed).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppoflow.infra.envs.sandbox import run_python
from ppoflow.infra.plugins.loader import load_object

__all__ = [
    "Tool",
    "ToolCall",
    "ToolResult",
    "FunctionTool",
    "PythonTool",
    "register_tool",
    "build_tool",
    "known_tools",
    "parse_tool_calls",
    "TOOL_CALL_RE",
]

_TOOLS: dict[str, Callable[..., Tool]] = {}

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN_RE = re.compile(r"<tool_call>\s*")


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from a turn: ``name`` and ``arguments``, or ``error`` when the text between
    the tags is not a call (the model is told so)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back to the model, and whether it was an error (for the metrics)."""

    name: str
    output: str
    ok: bool


class Tool:
    """A tool: ``name``, ``description``, JSON-schema ``parameters``, and ``run(arguments) -> str``."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def run(self, arguments: dict[str, Any]) -> str:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema ``apply_chat_template(tools=...)`` takes."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def call(self, arguments: dict[str, Any], max_chars: int = 1000) -> ToolResult:
        """``run`` with every failure turned into an ``Error: ...`` output; never raises."""
        required = self.parameters.get("required", [])
        missing = [k for k in required if k not in arguments]
        if missing:
            return ToolResult(self.name, f"Error: {self.name} needs the arguments {missing}", False)
        try:
            out = self.run(arguments)
        except Exception as exc:  # noqa: BLE001 - a tool's fault is the model's observation
            return ToolResult(self.name, f"Error: {type(exc).__name__}: {exc}"[:max_chars], False)
        text = str(out)
        ok = not text.startswith("Error:")
        return ToolResult(self.name, text if len(text) <= max_chars else text[: max_chars - 1] + "…", ok)


class FunctionTool(Tool):
    """A plain function as a tool: its name, its docstring, its keyword parameters (as strings or
    numbers). It runs in the rank's process."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        self.description = inspect.getdoc(fn) or self.name
        params = inspect.signature(fn).parameters
        self.parameters = {
            "type": "object",
            "properties": {k: {"type": "string"} for k in params},
            "required": [k for k, p in params.items() if p.default is inspect.Parameter.empty],
        }

    def run(self, arguments: dict[str, Any]) -> str:
        return str(self.fn(**arguments))


class PythonTool(Tool):
    """``python``: runs a snippet in the sandbox and returns what it printed (and the value of a
    last expression, like a calculator)."""

    name = "python"
    description = (
        "Run Python code and return what it prints; the value of a last expression is printed too "
        "(e.g. 12 * 34). No network, no files outside a fresh empty folder, a few seconds at most."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python code to run"}},
        "required": ["code"],
    }

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 1000):
        self.timeout_s, self.memory_mb, self.max_chars = timeout_s, memory_mb, max_chars

    def run(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return "Error: python needs a 'code' string"
        result = run_python(
            code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_chars=self.max_chars
        )
        if result.ok:
            return result.output.strip() or "(no output)"
        return result.output


def register_tool(name: str, *, override: bool = False) -> Callable[[Any], Any]:
    """Decorator: register a ``Tool`` subclass (built with the sandbox limits it accepts) or a
    plain function under ``name``."""

    def deco(obj: Any) -> Any:
        old = _TOOLS.get(name)
        if old is not None and old is not obj and not override:
            raise ValueError(f"a tool is already registered as {name!r}; pass override=True to replace it")
        _TOOLS[name] = obj
        return obj

    return deco


register_tool("python")(PythonTool)


def known_tools() -> list[str]:
    return sorted(_TOOLS)


def build_tool(spec: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 1000) -> Tool:
    """The tool a config names: a registered name or an import path (see the module docstring)."""
    obj = _TOOLS.get(spec)
    if obj is None:
        if ":" not in spec:
            raise KeyError(
                f"rollout.multi_turn.tools: no tool {spec!r}; registered: {', '.join(known_tools())}. "
                "Register one with @ppoflow.infra.envs.register_tool or name it 'package.module:name'"
            )
        obj = load_object(spec, "rollout.multi_turn.tools")
    if isinstance(obj, Tool):
        return obj
    if inspect.isclass(obj) and issubclass(obj, Tool):
        accepted = inspect.signature(obj).parameters
        limits = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_chars": max_chars}
        return obj(**{k: v for k, v in limits.items() if k in accepted})
    if callable(obj):
        return FunctionTool(obj, name=spec.rpartition(":")[2] if ":" in spec else spec)
    raise TypeError(f"rollout.multi_turn.tools: {spec!r} is a {type(obj).__name__}, not a Tool or a function")


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The ``<tool_call>{json}</tool_call>`` calls of a turn, in order. The closing tag may be
    missing (a small model often forgets it): the JSON object right after the opening tag counts.
    A call whose JSON does not parse, or lacks a string ``name`` or a dict ``arguments``, comes
    back with ``error`` set. ``arguments`` may also be a JSON string holding the dict."""
    calls = []
    decoder = json.JSONDecoder()
    for match in _OPEN_RE.finditer(text):
        body = text[match.end() :]
        try:
            obj, _ = decoder.raw_decode(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call is {"name": <tool>, "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls
