"""Held-out evaluation: when it runs during training, and how its responses are sampled."""

from __future__ import annotations

from pydantic import Field, model_validator

from ppoflow.infra.config.names import Section

__all__ = ["EvaluationConfig"]


class EvaluationConfig(Section):
    """Generations for ``data.val_files`` with the committed weights of an iteration, scored by the
    reward functions; metrics ``val/...`` per data source (docs/evaluation.md). Nothing runs
    without ``data.val_files``."""

    every: int = Field(
        5, ge=0, description="evaluate every k-th iteration during training (0: not during training)"
    )
    before_training: bool = Field(
        True, description="evaluate iteration 0 (the base policy) when an experiment starts"
    )
    at_end: bool = Field(True, description="evaluate the last iteration of every run")
    n: int = Field(1, ge=1, description="responses per prompt (best@n and pass@n when > 1)")
    temperature: float = Field(
        0.0, ge=0.0, description="0: greedy decoding (the default); > 0: sampling (needed for n > 1)"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1: no top-k cut")
    max_prompts: int | None = Field(
        None, ge=1, description="evaluate only the first max_prompts rows of data.val_files (None: all)"
    )
    response_length: int | None = Field(
        None, ge=1, description="max new tokens per response (None: rollout.response_length)"
    )
    pass_threshold: float = Field(
        1.0, description="a response passes when its score is >= this (pass@n: any of n passes)"
    )
    seed: int = Field(
        0,
        description="sampling seed (temperature > 0): the same for every iteration, so iterations "
        "are compared on the same random numbers",
    )
    samples_shown: int = Field(
        8, ge=0, description="rows of the generations table artifact in the Prefect UI"
    )

    @model_validator(mode="after")
    def _check(self) -> EvaluationConfig:
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"evaluation.n={self.n} with evaluation.temperature=0: greedy decoding gives one response "
                "per prompt; set evaluation.temperature > 0 (e.g. 0.6) for best@n / pass@n, or n=1"
            )
        return self
