"""Rule-based rewards: a registry keyed by each row's ``data_source``, and user functions by path.

    @register_reward("my_org/my_dataset")
    def my_rule(data_source, solution_str, ground_truth, extra_info=None) -> float | dict: ...

    scores = score_batch(data_sources, solution_strs, ground_truths, extra_infos)          # (B,) float32
    scores = score_batch(..., custom_function="my_pkg.rewards:score")  # one function for every row

A reward function gets the decoded response (``solution_str``, special tokens removed), the row's
``ground_truth`` and ``extra_info`` and returns a float, or a dict with a ``"score"`` float and
any other numbers (reported by :func:`score_batch_with_info`). Built in: GSM8K (``openai/gsm8k``,
``gsm8k``), see :func:`gsm8k_score`.

A custom function is named ``"package.module:function"`` (imported like any module, so the package
must be importable in the flow's process) or ``"path/to/file.py:function"``. It takes the same
four arguments and overrides the registry for every row.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import os
import re
import warnings
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

__all__ = [
    "register_reward",
    "get_reward_fn",
    "known_sources",
    "load_custom_function",
    "score_batch",
    "score_batch_with_info",
    "gsm8k_score",
    "extract_gsm8k_answer",
    "RewardFn",
    "RewardError",
]

RewardFn = Callable[[str, str, Any, Any], "float | dict[str, Any]"]

_LOG = logging.getLogger("ppoflow.rewards")

_REGISTRY: dict[str, RewardFn] = {}


class RewardError(ValueError):
    """A reward function raised, or returned something that is not a usable score (a non-finite
    number, a dict without ``score``, a string): the same rows give the same result, so retrying
    the task cannot help. Fix the reward function (named ``path:name`` in the message)."""


class RewardTypeError(RewardError, TypeError):
    """A reward function returned a value of the wrong type."""


_HOW_TO_REGISTER = (
    'register one with @ppoflow.infra.rewards.register_reward("<data_source>") in a module '
    "the flow imports, or set reward.custom_function='package.module:function'"
)


def register_reward(*data_sources: str, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: use the function for rows whose ``data_source`` is one of ``data_sources``.

    Registering a source twice raises unless ``override=True`` (two modules silently fighting
    over one dataset is a bug).
    """
    if not data_sources or not all(isinstance(s, str) and s for s in data_sources):
        raise ValueError(
            "register_reward needs one or more non-empty data_source strings, e.g. "
            '@register_reward("openai/gsm8k")'
        )

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"register_reward: {fn!r} is not callable")
        for source in data_sources:
            old = _REGISTRY.get(source)
            if old is not None and old is not fn and not override:
                raise ValueError(
                    f"a reward is already registered for data_source {source!r} "
                    f"({old.__module__}.{old.__qualname__}); pass override=True to replace it"
                )
            _REGISTRY[source] = fn
        return fn

    return deco


def known_sources() -> list[str]:
    """The registered ``data_source`` names, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(data_source: str) -> RewardFn:
    """The function registered for ``data_source``; ``KeyError`` listing the known ones if none."""
    fn = _REGISTRY.get(data_source)
    if fn is None:
        raise KeyError(
            f"no reward function for data_source {data_source!r}; known: "
            f"{', '.join(known_sources()) or 'none'}. To add one, {_HOW_TO_REGISTER}"
        )
    return fn


#: Modules of ppoflow 0.1 (top-level ``infra``, ``workers``, ...) that configs saved then may name,
#: and where they live now. Loading one still works, with a deprecation warning.
MOVED_MODULES = {
    "infra.demo_task": "ppoflow.demo.task",
    "infra.rewards": "ppoflow.infra.rewards",
}


def _import_module(path: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        moved = MOVED_MODULES.get(module_name)
        if moved is None or exc.name != module_name.split(".")[0]:
            raise ImportError(
                f"reward.custom_function={path!r}: cannot import module {module_name!r} ({exc}); "
                "install the package or put its directory on PYTHONPATH"
            ) from exc
    new_path = f"{moved}:{path.rpartition(':')[2]}"
    warnings.warn(
        f"reward.custom_function={path!r} names a module of ppoflow 0.1; it is {moved!r} now: "
        f"write {new_path!r} in the config",
        DeprecationWarning,
        stacklevel=3,
    )
    _LOG.warning(
        "reward.custom_function=%r is deprecated (ppoflow 0.1 module path); loading %r instead: "
        "write it in the config",
        path,
        new_path,
    )
    return importlib.import_module(moved)


@functools.lru_cache(maxsize=32)
def load_custom_function(path: str) -> RewardFn:
    """Import ``"package.module:function"`` or ``"path/to/file.py:function"`` and return the function."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward.custom_function={path!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(
                f"reward.custom_function={path!r}: file {module_name} does not exist "
                f"(relative paths resolve against {os.getcwd()})"
            )
        spec = importlib.util.spec_from_file_location(
            f"ppoflow_custom_reward_{abs(hash(module_name))}", module_name
        )
        assert spec is not None and spec.loader is not None  # a .py path always has a loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = _import_module(path, module_name)
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(
            f"reward.custom_function={path!r}: module {module_name!r} has no {attr!r} "
            f"(callables there: {', '.join(public[:20]) or 'none'})"
        )
    if not callable(fn):
        raise TypeError(f"reward.custom_function={path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def _as_score(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """A reward function's result -> (score, other numeric fields)."""
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


def _function_name(fn: Any, custom_function: str | RewardFn | None) -> str:
    """``path:name`` of a reward function: the config's import path, else its module and name."""
    if isinstance(custom_function, str):
        return custom_function
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"


def score_batch_with_info(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    custom_function: str | RewardFn | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
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
    custom = load_custom_function(custom_function) if isinstance(custom_function, str) else custom_function
    scores = np.zeros(n, dtype=np.float32)
    infos: dict[str, np.ndarray] = {}
    for i in range(n):
        source = str(data_sources[i])
        fn = custom if custom is not None else get_reward_fn(source)
        extra = None if extra_infos is None else extra_infos[i]
        where = f"reward function {_function_name(fn, custom_function)} (row {i}, data_source {source!r})"
        try:
            value = fn(source, solution_strs[i], ground_truths[i], extra)
        except Exception as exc:
            raise RewardError(
                f"{where} raised {type(exc).__name__}: {exc}. The same rows raise the same way, so the "
                "task is not retried: fix the function (it must return a float, or a dict with a "
                "'score' float, for any response), then run the same command again"
            ) from exc
        scores[i], info = _as_score(value, where)
        for key, value in info.items():
            infos.setdefault(key, np.full(n, np.nan, dtype=np.float32))[i] = value
    return scores, infos


def score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    custom_function: str | RewardFn | None = None,
) -> np.ndarray:
    """Score every response: (B,) float32.

    Each row uses ``custom_function`` when given (an import path or a callable), else the function
    registered for its ``data_source``.
    """
    return score_batch_with_info(data_sources, solution_strs, ground_truths, extra_infos, custom_function)[0]


# ------------------------------------------------------------------------------------------ GSM8K

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
