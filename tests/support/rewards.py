"""Reward functions that misbehave on purpose, for the failure tests (named by import path in
``reward.custom_function``)."""

from __future__ import annotations

from typing import Any


def always_nan(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """NaN for every response: the preflight's sample catches it."""
    return float("nan")


def nan_past_preflight(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """0.0 for the responses the preflight tries (empty, the ground truth); NaN for any other, so
    the error surfaces in the ``advantage`` task of a real iteration."""
    return 0.0 if solution_str in ("", str(ground_truth)) else float("nan")


def digit_share(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The share of the response's characters that are digits (0 for an empty one): a score that
    varies from response to response even for a tiny random policy."""
    return sum(c.isdigit() for c in solution_str) / len(solution_str) if solution_str else 0.0


def raises_key_error(data_source, solution_str, ground_truth, extra_info=None):
    """A reward function with a bug: it reads a key the rows do not have."""
    return float(extra_info["answer"] == solution_str)


def odd_prompts_only(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """0 for every response to an even-numbered prompt (a group without signal: dynamic sampling
    drops it); the response's length in characters / 100 for an odd-numbered one (differs between
    responses)."""
    index = (extra_info or {}).get("index", 0)
    return 0.0 if index % 2 == 0 else len(solution_str) / 100.0


def always_half(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """0.5 for every response: no group ever has signal, dynamic sampling cannot fill a batch."""
    return 0.5
