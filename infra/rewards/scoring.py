"""Scoring rows: each with the reward of its ``data_source``, or all with one custom reward.

    scores = score_batch(data_sources, solution_strs, ground_truths, extra_infos)          # (B,) float32
    scores = score_batch(..., custom_function="my_pkg.rewards:score")  # one reward for every row
    scores, info = score_requests([ScoreRequest(...), ...], reward)     # the same, from requests
    score = score_answer(row, text, reward)                            # one dataset row (environments)

A function reward is called row by row, in row order; a :class:`BatchScorer` once with all the
rows it scores (in row order). Every result is checked: a float (or a number-like with
``item()``), or a dict with a ``"score"`` float whose other numeric entries come back as ``info``;
finite. Anything else, or a function that raises, is a :class:`RewardError` naming the reward,
the row and its ``data_source``: the same rows fail the same way, so the task is not retried.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ppoflow.infra.rewards.registry import (
    BatchScorer,
    Reward,
    RewardError,
    RewardTypeError,
    ScoreRequest,
    get_reward_fn,
    load_custom_function,
    reward_name,
)

__all__ = ["score_requests", "score_batch", "score_batch_with_info", "score_answer"]

Scores = tuple[np.ndarray, dict[str, np.ndarray]]


def _as_score(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """A reward's result -> (score, other numeric fields)."""
    info: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{where} returned a dict without a 'score' key (keys: {sorted(value)})")
        info = {
            k: float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, (int, float, bool, np.number))
        }
        value = value["score"]
    if isinstance(value, (bool, int, float, np.number)) or (hasattr(value, "item") and callable(value.item)):
        score = float(value.item() if hasattr(value, "item") else value)
    else:
        raise RewardTypeError(
            f"{where} returned a {type(value).__name__}; a reward function returns a float or "
            "a dict with a 'score' float"
        )
    if not math.isfinite(score):
        raise RewardError(f"{where} returned a non-finite score ({score}); rewards must be finite")
    return score, info


def _where(reward: Any, spec: Any, i: int, request: ScoreRequest) -> str:
    kind = "reward scorer" if isinstance(reward, BatchScorer) else "reward function"
    return f"{kind} {reward_name(reward, spec)} (row {i}, data_source {request.data_source!r})"


def _call(fn: Any, request: ScoreRequest, where: str) -> Any:
    """One row through a function reward; what it raises becomes a :class:`RewardError`."""
    try:
        return fn(request.data_source, request.response, request.ground_truth, request.extra_info)
    except Exception as exc:
        raise RewardError(
            f"{where} raised {type(exc).__name__}: {exc}. The same rows raise the same way, so the "
            "task is not retried: fix the function (it must return a float, or a dict with a "
            "'score' float, for any response), then run the same command again"
        ) from exc


def _run_scorer(scorer: BatchScorer, requests: Sequence[ScoreRequest], rows: list[int]) -> Sequence[Any]:
    """The results of a :class:`BatchScorer` on ``rows``: as many as asked, or a RewardError.
    What the scorer raises goes on (retryable or not, as the scorer chose), with a note naming
    it and the rows."""
    try:
        results = scorer.score([requests[i] for i in rows])
    except Exception as exc:
        exc.add_note(f"while {scorer.name} scored rows {rows[0]}..{rows[-1]} ({len(rows)} rows)")
        raise
    if not isinstance(results, Sequence) or len(results) != len(rows):
        got = len(results) if isinstance(results, Sequence) else type(results).__name__
        raise RewardError(
            f"reward scorer {scorer.name} returned {got} results for {len(rows)} rows; a BatchScorer "
            "returns one result per request, in order"
        )
    return results


def score_requests(requests: Sequence[ScoreRequest], reward: str | Reward | None = None) -> Scores:
    """Score every request: ``(B,)`` float32 scores, and the other numeric fields of dict
    results, one ``(B,)`` float32 array per key (rows that did not report a key get NaN).

    ``reward`` (an import path, a function or a :class:`BatchScorer`) scores every row when
    given; otherwise each row's ``data_source`` picks the registered reward.
    """
    custom = load_custom_function(reward) if isinstance(reward, str) else reward
    n = len(requests)
    scores = np.zeros(n, dtype=np.float32)
    infos: dict[str, np.ndarray] = {}

    def put(i: int, value: Any, where: str) -> None:
        scores[i], info = _as_score(value, where)
        for key, number in info.items():
            infos.setdefault(key, np.full(n, np.nan, dtype=np.float32))[i] = number

    batched: dict[int, tuple[BatchScorer, list[int]]] = {}
    for i, request in enumerate(requests):
        fn = custom if custom is not None else get_reward_fn(request.data_source)
        if isinstance(fn, BatchScorer):
            batched.setdefault(id(fn), (fn, []))[1].append(i)
            continue
        where = _where(fn, reward, i, request)
        put(i, _call(fn, request, where), where)
    for scorer, rows in batched.values():
        for i, value in zip(rows, _run_scorer(scorer, requests, rows)):
            put(i, value, _where(scorer, reward, i, requests[i]))
    return scores, infos


def score_batch_with_info(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    custom_function: str | Reward | None = None,
) -> Scores:
    """Like :func:`score_batch`, plus the other numeric fields of dict results, one (B,) float32
    array per key (rows that did not report a key get NaN)."""
    n = len(solution_strs)
    if not (len(data_sources) == len(ground_truths) == n) or (
        extra_infos is not None and len(extra_infos) != n
    ):
        raise ValueError(
            f"score_batch: lengths differ (data_sources {len(data_sources)}, solution_strs {n}, "
            f"ground_truths {len(ground_truths)}, extra_infos "
            f"{None if extra_infos is None else len(extra_infos)})"
        )
    extras = [None] * n if extra_infos is None else list(extra_infos)
    requests = [
        ScoreRequest(str(s), text, truth, extra)
        for s, text, truth, extra in zip(data_sources, solution_strs, ground_truths, extras)
    ]
    return score_requests(requests, custom_function)


def score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    custom_function: str | Reward | None = None,
) -> np.ndarray:
    """Score every response: (B,) float32.

    Each row uses ``custom_function`` when given (an import path, a function or a
    :class:`BatchScorer`), else the reward registered for its ``data_source``.
    """
    return score_batch_with_info(data_sources, solution_strs, ground_truths, extra_infos, custom_function)[0]


def score_answer(row: Mapping[str, Any], text: str, reward: str | Reward | None = None) -> float:
    """The score of ``text`` as the answer to one dataset row (its non-tensor columns, as an
    environment's ``reset`` gets them), by ``reward`` or the row's ``data_source``: how an
    environment scores a final answer the way single-turn rollouts are scored."""
    scores, _ = score_requests([ScoreRequest.from_row(row, text)], reward)
    return float(scores[0])
