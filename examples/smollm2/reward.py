"""The reward of the SmolLM2 arithmetic example: 1.0 when the last number in the response is the
sum, else 0.0 (``reward.custom_function: examples/smollm2/reward.py:score``)."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+")


def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the response's last integer equals ``ground_truth``, else 0.0."""
    numbers = _NUMBER.findall(solution_str.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == int(str(ground_truth)) else 0.0
