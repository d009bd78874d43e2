"""The demo's task: name the larger of two digits, checked by a rule.

A prompt is one user message ``"max(3,7)="``; a correct response is the larger digit (``"7"``)
followed by the end-of-text token. The rule (:func:`score`, registered for the data source
:data:`DATA_SOURCE`) gives 1.0 for exactly the right number (surrounding whitespace allowed) and 0.0
for anything else, so the mean reward of a batch is its accuracy.

Problems are drawn with the *answer* uniform over 0..9, the other digit uniform over 0..answer,
and the two in random order: every answer is equally likely, so a policy cannot score by betting
on the most frequent one (with two independent digits, "9" alone would be right 19% of the time).
There are 100 distinct problems and 10 possible answers, so guessing scores 0.1.

Why this task: it is verifiable by a one-line rule, its reward is in [0, 1], and a tiny Qwen2 (two
layers, hidden 128) learns it from the reward alone within a demo's budget on a CPU: it first
learns to answer with one of the two digits it was given (right about half the time), then to
pick the larger. (Single-digit addition was the first candidate: the same model learns it too,
but how soon it starts varies a lot with the seed.)

The warm start (:func:`warm_start_examples`, used with ``ppoflow.demo.sft``) teaches only the *format*:
the same kind of prompts with uniformly random answers. The warm-started policy answers every
prompt with a single digit and stops, and is right one time in ten; what it learns beyond that it
learns from the reward.

    rows = build_rows(1024, seed=0)                # veRL-format dicts
    write_parquet(rows, "runs/demo/data/train.parquet")
    score("ppoflow/larger_digit", " 7", "7")       # 1.0
"""

from __future__ import annotations

import random
import re
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.rewards import register_reward

__all__ = [
    "DATA_SOURCE",
    "ABILITY",
    "make_problem",
    "build_rows",
    "every_problem",
    "write_parquet",
    "warm_start_examples",
    "supervised_examples",
    "score",
    "parse_answer",
]

DATA_SOURCE = "ppoflow/larger_digit"
ABILITY = "comparison"
_NUMBER = re.compile(r"\s*(\d{1,4})\s*")


def make_problem(rng: random.Random, max_digit: int = 9) -> tuple[str, str]:
    """One ``(question, answer)``, e.g. ``("max(3,7)=", "7")``: the answer uniform over 0..max_digit."""
    if not 0 <= max_digit <= 9:
        raise ValueError(f"max_digit={max_digit}: the problems are about digits 0..9")
    answer = rng.randint(0, max_digit)
    other = rng.randint(0, answer)
    first, second = (answer, other) if rng.random() < 0.5 else (other, answer)
    return f"max({first},{second})=", str(answer)


def build_rows(count: int, seed: int = 0, max_digit: int = 9, split: str = "train") -> list[dict[str, Any]]:
    """``count`` problems as rows in veRL's prompt format.

    Each row: ``prompt`` = [{"role": "user", "content": "max(3,7)="}], ``data_source`` =
    :data:`DATA_SOURCE`, ``ability``, ``reward_model`` = {"style": "rule", "ground_truth": "7"},
    ``extra_info`` = {"split", "index", "question"}.
    """
    if count < 1:
        raise ValueError(f"count={count}: need at least one problem")
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        question, answer = make_problem(rng, max_digit)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question}],
                "ability": ABILITY,
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index, "question": question},
            }
        )
    return rows


def every_problem(max_digit: int = 9) -> list[dict[str, Any]]:
    """Every distinct problem once, ``max(a,b)=`` for each ordered pair of digits: the demo's
    evaluation set. The task has only these (100 for digits 0..9), so the demo evaluates all of
    them, greedily: what the policy answers, not a sample at temperature 1."""
    rows: list[dict[str, Any]] = []
    for first in range(max_digit + 1):
        for second in range(max_digit + 1):
            question = f"max({first},{second})="
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": question}],
                    "ability": ABILITY,
                    "reward_model": {"style": "rule", "ground_truth": str(max(first, second))},
                    "extra_info": {"split": "test", "index": len(rows), "question": question},
                }
            )
    return rows


def write_parquet(rows: list[dict[str, Any]], url: str, storage_options: dict | None = None) -> str:
    """Write ``rows`` as one parquet file at ``url`` (any fsspec URL, published atomically)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    storage.write_bytes_atomic(url, buf.getvalue(), storage_options=storage_options)
    return url


def warm_start_examples(
    count: int, seed: int = 0, max_digit: int = 9
) -> list[tuple[list[dict[str, str]], str]]:
    """``(messages, response)`` pairs for the format warm start: real prompts, *random* answers.

    The answer is drawn uniformly from 0..max_digit independently of the prompt, so supervised
    training on these teaches the shape of a response (one number, then stop) and nothing about
    which number is right.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, _answer = make_problem(rng, max_digit)
        out.append(([{"role": "user", "content": question}], str(rng.randint(0, max_digit))))
    return out


def supervised_examples(
    count: int, seed: int = 0, max_digit: int = 9
) -> list[tuple[list[dict[str, str]], str]]:
    """``(messages, response)`` pairs with the *right* answers: the warm start's format, taught with
    the task itself. A model fine-tuned on these knows the task: the distillation example's teacher
    (examples/distill)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        question, answer = make_problem(rng, max_digit)
        out.append(([{"role": "user", "content": question}], answer))
    return out


def parse_answer(solution_str: str) -> int | None:
    """The number a response states, or None unless it is exactly one number (whitespace allowed)."""
    match = _NUMBER.fullmatch(solution_str)
    return int(match.group(1)) if match else None


@register_reward(DATA_SOURCE)
def score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 if the response is exactly the right number, else 0.0."""
    answer = parse_answer(solution_str)
    try:
        truth = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"{DATA_SOURCE}: ground truth {ground_truth!r} is not an integer") from None
    return 1.0 if answer is not None and answer == truth else 0.0
