"""Multi-turn rollouts: the ``rollout.multi_turn`` section (an environment, its tools and limits)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ppoflow.infra.config.names import Section

__all__ = ["MultiTurnConfig"]


class MultiTurnConfig(Section):
    """An agent loop inside the rollout: the policy's turns alternate with the environment's
    (tool outputs, replies) until the environment says done, ``max_turns`` policy turns were
    sampled, or the episode's tokens reach ``rollout.response_length`` (the episode token budget:
    policy and environment tokens together, after the prompt). docs/multiturn.md."""

    enable: bool = False
    environment: str = Field(
        "tools",
        description="a registered environment name ('tools': the built-in tool-use environment) or "
        "'package.module:Class' / 'path/to/file.py:Class'",
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment class (JSON)"
    )
    max_turns: int = Field(4, ge=1, description="most policy turns per episode")
    max_turn_tokens: int | None = Field(
        None, ge=1, description="most tokens sampled in one policy turn; None = rollout.response_length"
    )
    tools: list[str] = Field(
        default_factory=lambda: ["python"],
        description="tools offered to the policy: registered names ('python': the sandboxed Python "
        "calculator) or 'package.module:name' / 'path/to/file.py:name' import paths",
    )
    tool_format: Literal["auto", "template", "tag"] = Field(
        "auto",
        description="template: the tools go through the chat template's own tool format "
        "(apply_chat_template(tools=...), Hermes/Qwen <tool_call> JSON); tag: a system message "
        "describes the tools and the <tool_call>{json}</tool_call> tag; auto: template when the "
        "tokenizer's template has a <tool_call> tool format, else tag",
    )
    tool_timeout_s: float = Field(5.0, gt=0.0, description="wall-clock limit of one sandboxed tool call")
    tool_memory_mb: int = Field(512, ge=16, description="address-space limit of one sandboxed tool call")
    tool_output_chars: int = Field(
        1000, ge=16, description="a tool's output is cut to this many characters before the model sees it"
    )
    env_workers: int = Field(8, ge=1, description="threads stepping the environments of a batch")

    @model_validator(mode="after")
    def _check(self) -> MultiTurnConfig:
        if self.enable and not self.environment.strip():
            raise ValueError(
                "rollout.multi_turn.environment is empty: name 'tools' or 'package.module:Class'"
            )
        return self
