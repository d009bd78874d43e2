"""The rules built in, registered by ``data_source`` when :mod:`ppoflow.infra.rewards` is imported.
Answers are compared by Hugging Face's ``math-verify`` (:func:`math_equal`): ``0.5`` equals
``\\frac{1}{2}``, ``1,000`` equals ``1000``, ``2\\sqrt{2}`` equals ``\\sqrt{8}``, intervals and sets
compare as such.

- GSM8K (``openai/gsm8k``, ``gsm8k``): :func:`gsm8k_score`. The ground truth is the dataset's
  own format, a solution ending ``#### <number>`` or the bare number; the response's answer is
  the number after its last ``####`` (the format GSM8K prompts ask for, as in veRL), else its
  last ``\\boxed{}``.
- MATH (``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
  ``math``): :func:`math_score`, the response's last ``\\boxed{}`` (else its last LaTeX or plain
  expression, math-verify's extraction) against the ground truth (an answer, or a solution with
  a ``\\boxed{}``).

:func:`math_verify_score` is the same comparison as a reward any dataset can register.

math-verify bounds parsing with ``signal.alarm``, which only the main thread may set: elsewhere
(the flow's tasks run in threads) it parses without a time limit, on the last
:data:`MAX_ANSWER_CHARS` characters of the response.

The demo's rule (``ppoflow/larger_digit``) lives with its task, :mod:`ppoflow.demo.task`.
"""

from __future__ import annotations

import logging
import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Any

from ppoflow.infra.rewards.registry import register_reward

__all__ = [
    "gsm8k_score",
    "extract_gsm8k_answer",
    "math_score",
    "math_verify_score",
    "math_equal",
    "MATH_SOURCES",
    "MAX_ANSWER_CHARS",
]

MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")
#: How much of a response's end math-verify reads (its answer is there; sympy on pages of text
#: can take minutes, with no time limit off the main thread).
MAX_ANSWER_CHARS = 2000
#: math-verify's time limit per parse or comparison, in the main thread.
TIMEOUT_S = 5

_ANSWER_RE = re.compile(r"####\s*(-?)\s*\$?\s*(-?(?:\d[\d,]*)?(?:\.\d+)?)")
_LOG = logging.getLogger("ppoflow.rewards")
logging.getLogger("math_verify").setLevel(logging.ERROR)  # its one-time "timeout is disabled" warning


def _to_decimal(text: str) -> Decimal | None:
    text = text.replace(",", "").replace("$", "").strip()
    if not text or text in ("-", ".", "-."):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def extract_gsm8k_answer(text: str) -> Decimal | None:
    """The number after the last parsable ``#### <answer>`` in ``text`` (commas and ``$`` ignored):
    GSM8K's answer format."""
    for sign, number in reversed(_ANSWER_RE.findall(text)):
        value = _to_decimal(number)
        if value is not None:
            return -value if sign and value > 0 else value
    return None


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str, *, boxed_only: bool = False) -> list[Any]:
    """math-verify's parse of ``text`` from its last ``\\boxed`` on (math-verify would take the
    first): its answers (sympy objects and their strings), [] if none."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    last_box = text.rfind("\\boxed")
    text = text[last_box:] if last_box >= 0 else text

    configs: list[Any] = [LatexExtractionConfig(boxed_match_priority=0)]
    if boxed_only:
        configs = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    else:
        configs.append(ExprExtractionConfig())
    return list(parse(text[-MAX_ANSWER_CHARS:], configs, parsing_timeout=_timeout()))


def _gold(answer: str) -> list[Any]:
    """The parse of a ground truth: its ``\\boxed{}`` if it has one, else the whole answer."""
    text = str(answer).strip()
    return _parse(text if "\\boxed" in text else f"\\boxed{{{text}}}")


def math_equal(gold: list[Any], answer: list[Any]) -> bool:
    """Whether two math-verify parses are the same answer (False when either is empty)."""
    from math_verify import verify

    if not gold or not answer:
        return False
    return bool(verify(gold, answer, timeout_seconds=_timeout()))


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Any = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """GSM8K: ``score`` when the response's answer (see the module docstring) equals the ground
    truth, ``format_score`` when an answer is there but wrong, else 0.

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
    if answer is not None:
        return score if answer == truth else format_score
    boxed = _parse(solution_str, boxed_only=True)
    if not boxed:
        return 0.0
    return score if math_equal(_parse(f"\\boxed{{{truth}}}"), boxed) else format_score


def math_verify_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """1.0 when the response's answer (its last ``\\boxed{}``, else its last expression) equals
    ``ground_truth`` by math-verify, else 0.0."""
    if ground_truth is None or not str(ground_truth).strip():
        raise ValueError(
            f"{data_source!r}: the ground truth is empty; reward_model.ground_truth must hold the answer"
        )
    return 1.0 if math_equal(_gold(str(ground_truth)), _parse(solution_str)) else 0.0


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """MATH: :func:`math_verify_score` (the ground truth is the answer, or a solution with its
    ``\\boxed{}``)."""
    return math_verify_score(data_source, solution_str, ground_truth, extra_info)


register_reward("openai/gsm8k", "gsm8k")(gsm8k_score)
register_reward(*MATH_SOURCES)(math_score)
