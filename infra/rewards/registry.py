"""What a reward is, and which one scores a row.

    @register_reward("my_org/my_dataset")
    def my_rule(data_source, solution_str, ground_truth, extra_info=None) -> float | dict: ...

    class MyService(BatchScorer):                # scores a whole batch at once
        def score(self, requests: Sequence[ScoreRequest]) -> list[float | dict]: ...
    register_reward("my_org/judged")(MyService())

A reward is a function of one row (:data:`RewardFn`: the decoded response as ``solution_str``,
special tokens removed, the row's ``ground_truth`` and ``extra_info``) or a :class:`BatchScorer`,
which gets every row it scores in one call (what a reward service over the network, or a verifier
that batches, implements). Either returns, per row, a float or a dict with a ``"score"`` float and
any other numbers. The registry maps each row's ``data_source`` to one; ``reward.custom_function``
names one (:func:`load_custom_function`) that scores every row instead.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ppoflow.infra.plugins.loader import load_object

__all__ = [
    "RewardFn",
    "Reward",
    "ScoreRequest",
    "BatchScorer",
    "RewardError",
    "RewardTypeError",
    "register_reward",
    "get_reward_fn",
    "known_sources",
    "load_custom_function",
    "reward_name",
    "jsonable",
]

RewardFn = Callable[[str, str, Any, Any], "float | dict[str, Any]"]


class RewardError(ValueError):
    """A reward function raised, or returned something that is not a usable score (a non-finite
    number, a dict without ``score``, a string): the same rows give the same result, so retrying
    the task cannot help. Fix the reward function (named ``path:name`` in the message)."""


class RewardTypeError(RewardError, TypeError):
    """A reward function returned a value of the wrong type."""


@dataclass(frozen=True)
class ScoreRequest:
    """One response to score: the row's ``data_source``, the decoded ``response``, its
    ``ground_truth`` and ``extra_info``, and its ``prompt`` (the dataset's ``raw_prompt``: chat
    messages or a string; None where the caller has none)."""

    data_source: str
    response: str
    ground_truth: Any = None
    extra_info: Any = None
    prompt: Any = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], response: str) -> ScoreRequest:
        """The request of ``response`` to a dataset row: its non-tensor columns (``data_source``,
        ``ground_truth``, ``extra_info``, ``raw_prompt``; missing ones are None)."""
        return cls(
            str(row.get("data_source", "")),
            response,
            row.get("ground_truth"),
            row.get("extra_info"),
            row.get("raw_prompt"),
        )

    def to_json(self) -> dict[str, Any]:
        """The request as a JSON object (what a reward service receives)."""
        return {
            "data_source": self.data_source,
            "prompt": jsonable(self.prompt),
            "response": self.response,
            "ground_truth": jsonable(self.ground_truth),
            "extra_info": jsonable(self.extra_info),
        }


def jsonable(value: Any) -> Any:
    """``value`` as JSON can carry it: mappings with string keys, sequences (tuples, sets, numpy
    arrays) as lists, numpy numbers by ``item()``, other objects as text."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and numbers
        return jsonable(value.tolist())
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return str(value)


class BatchScorer(ABC):
    """A reward that scores many rows in one call.

    ``score`` returns one result per request, in order: a float, or a dict with a ``"score"``
    float and any other numbers. What it raises reaches the task as it is: raise
    :class:`RewardError` for an answer no retry can fix (the task fails at once), anything else
    (a connection refused, a timeout) for what a retry of the task may fix.
    """

    @property
    def name(self) -> str:
        """How errors and logs name the scorer."""
        return f"{type(self).__module__}:{type(self).__qualname__}"

    @abstractmethod
    def score(self, requests: Sequence[ScoreRequest]) -> Sequence[float | dict[str, Any]]:
        """One result per request, in order."""


Reward: TypeAlias = RewardFn | BatchScorer

_REGISTRY: dict[str, Reward] = {}

_HOW_TO_REGISTER = (
    'register one with @ppoflow.infra.rewards.register_reward("<data_source>") in a module '
    "the flow imports, or set reward.custom_function='package.module:function'"
)


def register_reward(*data_sources: str, override: bool = False) -> Callable[[Any], Any]:
    """Decorator: use the function (or :class:`BatchScorer`) for rows whose ``data_source`` is one
    of ``data_sources``. A source ending in ``/*`` names a family: ``"reasoning_gym/*"`` scores
    every ``reasoning_gym/<task>`` that has no reward of its own (the longest family wins).

    Registering a source twice raises unless ``override=True`` (two modules silently fighting
    over one dataset is a bug).
    """
    if not data_sources or not all(isinstance(s, str) and s for s in data_sources):
        raise ValueError(
            "register_reward needs one or more non-empty data_source strings, e.g. "
            '@register_reward("openai/gsm8k")'
        )

    def deco(reward: Any) -> Any:
        if not (isinstance(reward, BatchScorer) or callable(reward)):
            raise TypeError(f"register_reward: {reward!r} is neither a function nor a BatchScorer")
        for source in data_sources:
            old = _REGISTRY.get(source)
            if old is not None and old is not reward and not override:
                raise ValueError(
                    f"a reward is already registered for data_source {source!r} "
                    f"({reward_name(old)}); pass override=True to replace it"
                )
            _REGISTRY[source] = reward
        return reward

    return deco


def known_sources() -> list[str]:
    """The registered ``data_source`` names, sorted."""
    return sorted(_REGISTRY)


def _family(data_source: str) -> Reward | None:
    """The reward of the longest registered family (``prefix/*``) that ``data_source`` is in."""
    head = data_source
    while "/" in head:
        head = head.rpartition("/")[0]
        reward = _REGISTRY.get(head + "/*")
        if reward is not None:
            return reward
    return None


def get_reward_fn(data_source: str) -> Reward:
    """The reward registered for ``data_source`` (or for its family, ``prefix/*``); ``KeyError``
    listing the known ones if none."""
    reward = _REGISTRY.get(data_source)
    if reward is None:
        reward = _family(data_source)
    if reward is None:
        raise KeyError(
            f"no reward function for data_source {data_source!r}; known: "
            f"{', '.join(known_sources()) or 'none'}. To add one, {_HOW_TO_REGISTER}"
        )
    return reward


@functools.lru_cache(maxsize=32)
def load_custom_function(spec: str) -> Reward:
    """The reward ``reward.custom_function`` names: a function, a :class:`BatchScorer` instance,
    or a :class:`BatchScorer` subclass (built once, with no arguments)."""
    obj = load_object(spec, "reward.custom_function", "function")
    if isinstance(obj, type) and issubclass(obj, BatchScorer):
        obj = obj()
    if isinstance(obj, BatchScorer) or (callable(obj) and not isinstance(obj, type)):
        return obj
    raise TypeError(
        f"reward.custom_function={spec!r}: {spec.rpartition(':')[2]!r} is a {type(obj).__name__}, "
        "not a function or a BatchScorer; name a function score(data_source, solution_str, "
        "ground_truth, extra_info) -> float"
    )


def reward_name(reward: Any, spec: Any = None) -> str:
    """``path:name`` of a reward: the config's import path when it came from one, else its module
    and name."""
    if isinstance(spec, str):
        return spec
    if isinstance(reward, BatchScorer):
        return reward.name
    return f"{getattr(reward, '__module__', '?')}:{getattr(reward, '__qualname__', reward)}"
