"""The rules built in, registered by ``data_source`` when :mod:`ppoflow.infra.rewards` is imported.

- GSM8K (``openai/gsm8k``, ``gsm8k``): :func:`gsm8k_score`, the number after the last ``####``.

The demo's rule (``ppoflow/larger_digit``) lives with its task, :mod:`ppoflow.demo.task`.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from ppoflow.infra.rewards.registry import register_reward

__all__ = ["gsm8k_score", "extract_gsm8k_answer"]

_ANSWER_RE = re.compile(r"####\s*(-?)\s*\$?\s*(-?(?:\d[\d,]*)?(?:\.\d+)?)")


def _to_decimal(text: str) -> Decimal | None:
    text = text.replace(",", "").replace("$", "").strip()
    if not text or text in ("-", ".", "-."):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def extract_gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last parsable ``#### <answer>`` in ``text`` (commas and ``$`` ignored)."""
    for sign, number in reversed(_ANSWER_RE.findall(text)):
        value = _to_decimal(number)
        if value is not None:
            return -value if sign and value > 0 else value
    return None


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K: ``score`` when the last ``#### <answer>`` equals the ground truth numerically
    (``1,000`` == ``1000.0``), ``format_score`` when an answer is there but wrong, else 0.

    ``ground_truth`` is the bare answer (``"72"``) or a full GSM8K solution ending in ``#### 72``.
    ``extra_info`` may carry ``{"format_score": 0.1}`` to reward a parsable wrong answer.
    """
    if isinstance(extra_info, dict) and "format_score" in extra_info:
        format_score = float(extra_info["format_score"])
    truth_text = str(ground_truth)
    truth = extract_gsm8k_answer(truth_text) if "####" in truth_text else _to_decimal(truth_text)
    if truth is None:
        raise ValueError(
            f"gsm8k ground truth {ground_truth!r} is not a number; the dataset's "
            "reward_model.ground_truth must hold the final answer (e.g. '72')"
        )
    answer = extract_gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == truth else format_score


register_reward("openai/gsm8k", "gsm8k")(gsm8k_score)
