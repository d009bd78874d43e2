"""reasoning-gym tasks, scored by each task's own scorer: rows whose ``data_source`` is
``reasoning_gym/<task>`` (what :mod:`ppoflow.infra.datasets.reasoning_gym` writes).

The row carries what the scorer needs, so nothing is generated again: ``extra_info`` holds the
task's entry (``{"question", "answer", "metadata"}``) as JSON under ``reasoning_gym_entry`` and the
task's config under ``reasoning_gym_config``. The response's answer is the text of its last
``<answer>...</answer>`` (``reasoning_gym.utils.extract_answer``, the library's convention: the
system prompt written with the data asks for it), or, for rows written with
``answer_format: tags_or_last_number`` (``extra_info["answer_format"]``: numeric tasks and models
too small to follow the tag format), the last number of a response without tags; the score is
``dataset.score_answer(answer, entry)`` of a dataset built once per (task, config), a float in
[0, 1] (1 for the right answer; some tasks give partial credit). No answer tags: the scorer gets
``None`` and scores it (0 for every task).

reasoning-gym is an optional dependency (``pip install 'ppoflow[reasoning-gym]'``), imported the
first time a row is scored.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from ppoflow.infra.rewards.registry import jsonable, register_reward

__all__ = [
    "DATA_SOURCE_PREFIX",
    "ENTRY_KEY",
    "CONFIG_KEY",
    "data_source_of",
    "task_of",
    "encode_entry",
    "decode_entry",
    "reasoning_gym_score",
    "import_reasoning_gym",
    "reasoning_gym_version",
    "ANSWER_FORMATS",
    "answer_of",
]

DATA_SOURCE_PREFIX = "reasoning_gym/"
ENTRY_KEY = "reasoning_gym_entry"
CONFIG_KEY = "reasoning_gym_config"
FORMAT_KEY = "answer_format"
#: How a response's answer is found: ``tags`` (the last ``<answer>...</answer>``), or
#: ``tags_or_last_number`` (those tags, else the response's last number).
ANSWER_FORMATS = ("tags", "tags_or_last_number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXTRA = "pip install 'ppoflow[reasoning-gym]' (reasoning-gym==0.1.25)"


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` module, or an ImportError that says how to install it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"reasoning-gym tasks need the reasoning-gym package: {EXTRA}") from exc
    return reasoning_gym


def reasoning_gym_version() -> str:
    """The installed reasoning-gym distribution's version, as errors name it (the package's own
    ``__version__`` lags its releases: 0.1.25 says 0.1.19)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reasoning-gym")
    except PackageNotFoundError:  # importable, but not installed as a distribution (a source tree)
        return str(getattr(import_reasoning_gym(), "__version__", "(version unknown)"))


def data_source_of(task: str) -> str:
    return DATA_SOURCE_PREFIX + task


def task_of(data_source: str) -> str:
    """``basic_arithmetic`` of ``reasoning_gym/basic_arithmetic``."""
    if not data_source.startswith(DATA_SOURCE_PREFIX) or len(data_source) == len(DATA_SOURCE_PREFIX):
        raise ValueError(f"data_source {data_source!r} is not {DATA_SOURCE_PREFIX}<task>")
    return data_source[len(DATA_SOURCE_PREFIX) :]


def encode_entry(entry: dict[str, Any]) -> str:
    """The entry as the JSON text a row carries."""
    return json.dumps(jsonable(entry), sort_keys=True)


def decode_entry(extra_info: Any, data_source: str) -> dict[str, Any]:
    """The entry a row carries in ``extra_info``; ValueError naming what is missing."""
    text = extra_info.get(ENTRY_KEY) if isinstance(extra_info, dict) else None
    if not isinstance(text, str):
        raise ValueError(
            f"a {data_source!r} row has no extra_info[{ENTRY_KEY!r}] (the task's entry as JSON): "
            "write the data with `ppoflow data reasoning-gym`, which puts it there"
        )
    entry = json.loads(text)
    if not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError(f"extra_info[{ENTRY_KEY!r}] of a {data_source!r} row is not a task entry")
    return entry


@functools.lru_cache(maxsize=256)
def _dataset(task: str, config_json: str) -> Any:
    """A dataset of ``task`` with the config the data was written with (size 1: only its
    ``score_answer`` is used)."""
    rg = import_reasoning_gym()
    config = json.loads(config_json) if config_json else {}
    config.update(size=1)
    try:
        return rg.create_dataset(task, **config)
    except ValueError as exc:
        if task not in rg.factory.DATASETS:
            raise ValueError(
                f"{data_source_of(task)!r}: reasoning-gym {reasoning_gym_version()} has no task {task!r}"
            ) from exc
        raise


def answer_of(text: str, answer_format: str = "tags") -> str | None:
    """The answer in a response (see :data:`ANSWER_FORMATS`); None when it has none."""
    from reasoning_gym.utils import extract_answer

    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format {answer_format!r}: one of {', '.join(ANSWER_FORMATS)}")
    answer = extract_answer(text)
    if answer is None and answer_format == "tags_or_last_number":
        numbers = _NUMBER.findall(text.replace(",", ""))
        answer = numbers[-1] if numbers else None
    return answer


def reasoning_gym_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> float:
    """The task's own score of the response's last ``<answer>`` (see the module docstring)."""
    entry = decode_entry(extra_info, data_source)
    config = extra_info.get(CONFIG_KEY) or ""
    dataset = _dataset(task_of(data_source), config if isinstance(config, str) else json.dumps(config))
    return float(dataset.score_answer(answer_of(solution_str, extra_info.get(FORMAT_KEY) or "tags"), entry))


register_reward(DATA_SOURCE_PREFIX + "*")(reasoning_gym_score)
