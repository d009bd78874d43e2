"""reasoning-gym tasks as veRL-format parquet: a train file and a held-out file with no question
in both.

    mix = TaskMix(tasks=[TaskSpec(name="basic_arithmetic", weight=2), TaskSpec(name="leg_counting")],
                  train=2048, test=256, seed=0)
    written = write_task_mix(mix, "runs/rg/data")     # train.parquet, test.parquet (+ counts)

    ppoflow data reasoning-gym --task basic_arithmetic:2 --task leg_counting \\
        --train 2048 --test 256 --seed 0 --out runs/rg/data    # the same, from the command line
    ppoflow data reasoning-gym --spec mix.yaml --out runs/rg/data  # a YAML TaskMix

Each task's rows come from ``reasoning_gym.create_dataset(task, seed=<seed of the mix and the
task>, **config)``, its config the spec's ``config`` over the one of its curriculum ``level``
(reasoning-gym's coaching API: a fixed difficulty; see docs/tasks.md). The rows of each split are
split among the tasks by weight (largest remainders), in a seeded shuffle. Held-out questions are
drawn first, then train questions that are neither held out nor drawn before: the held-out file
stays the same when only ``train`` changes. A task whose generator cannot give that many distinct
questions is an error that says how many it gave.

A row (``ppoflow.infra.data.prompts``' format)::

    data_source   reasoning_gym/<task>
    prompt        [{"role": "system", "content": <system prompt>}, {"role": "user", "content": question}]
    ability       reasoning
    reward_model  {"style": "rule", "ground_truth": <the entry's answer>}
    extra_info    {"split", "index", "task", reasoning_gym_entry: <entry JSON>,
                   reasoning_gym_config: <config JSON>, answer_format: "tags" | "tags_or_last_number"}

and :mod:`ppoflow.infra.rewards.reasoning_gym` scores it with the task's own scorer from
``extra_info`` alone. Before anything is written every entry is checked to score its own answer
1 after the round trip through JSON, so a task whose scorer needs what JSON loses fails here, not
in training. Both files are built in memory and published atomically, the held-out one first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from collections.abc import Sequence
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ppoflow.infra.data import storage
from ppoflow.infra.rewards.reasoning_gym import (
    CONFIG_KEY,
    ENTRY_KEY,
    FORMAT_KEY,
    data_source_of,
    decode_entry,
    encode_entry,
    import_reasoning_gym,
    reasoning_gym_version,
)

__all__ = ["TaskSpec", "TaskMix", "split_counts", "task_config", "build_rows", "write_task_mix"]

#: How many entries per wanted row a task's generator may be asked for before it is declared
#: too small for the sizes asked.
DRAWS_PER_ROW = 20
SPLITS = ("test", "train")


class TaskSpec(BaseModel):
    """One task of a mix: a reasoning-gym dataset name, its share, its config."""

    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float = Field(1.0, gt=0)
    config: dict[str, Any] = Field(default_factory=dict, description="the task's config fields")
    level: int | None = Field(
        None, ge=0, description="the task's curriculum level (its config under `config`)"
    )

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, config: dict[str, Any]) -> dict[str, Any]:
        for key in ("seed", "size"):
            if key in config:
                raise ValueError(f"config.{key}: the mix sets it (its seed and train/test sizes)")
        return config


class TaskMix(BaseModel):
    """Tasks, their weights, the sizes of the two files and the seed."""

    model_config = ConfigDict(extra="forbid")
    tasks: list[TaskSpec] = Field(min_length=1)
    train: int = Field(ge=1)
    test: int = Field(ge=1)
    seed: int = 0
    system_prompt: str | None = Field(
        "default",
        description="a name of reasoning_gym.utils.SYSTEM_PROMPTS, or the text itself; None: none",
    )
    answer_format: Literal["tags", "tags_or_last_number"] = Field(
        "tags",
        description="where the reward finds a response's answer: its last <answer>...</answer>, or "
        "those tags else its last number (numeric tasks, models too small to follow the tags)",
    )

    @field_validator("tasks")
    @classmethod
    def _distinct(cls, tasks: list[TaskSpec]) -> list[TaskSpec]:
        names = [t.name for t in tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"task {dup[0]!r} is listed twice; give it one entry and a weight")
        return tasks


def split_counts(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` rows split by ``weights``: floors, then one more to the largest remainders (ties:
    the earlier task). Sums to ``total``."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _task_seed(seed: int, task: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{task}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def task_config(spec: TaskSpec) -> dict[str, Any]:
    """The config of a task: its curriculum level's (when ``level`` is set), then ``config``."""
    rg = import_reasoning_gym()
    if spec.name == "composite" or spec.name not in rg.factory.DATASETS:
        raise ValueError(
            f"reasoning-gym {reasoning_gym_version()} has no task {spec.name!r}"
            + (" to list (a mix is the composite)" if spec.name == "composite" else "")
            + f"; tasks: {', '.join(sorted(set(rg.factory.DATASETS) - {'composite'}))}"
        )
    config: dict[str, Any] = {}
    if spec.level is not None:
        if not rg.factory.has_curriculum(spec.name):
            raise ValueError(f"task {spec.name!r} has no curriculum: drop its level, set its config")
        curriculum = rg.factory.create_curriculum(spec.name)
        try:
            curriculum.set_global_level(spec.level)
        except (ValueError, IndexError) as exc:
            raise ValueError(f"task {spec.name!r}: level {spec.level} does not exist ({exc})") from exc
        config = dataclasses.asdict(curriculum.generate_configuration({"seed": 0, "size": 1}))
        config.pop("seed"), config.pop("size")
    config.update(spec.config)
    return json.loads(json.dumps(config, default=list))  # what the row can carry (tuples as lists)


def _system_messages(system_prompt: str | None) -> list[dict[str, str]]:
    if system_prompt is None:
        return []
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return [{"role": "system", "content": SYSTEM_PROMPTS.get(system_prompt, system_prompt)}]


def _check_round_trip(dataset: Any, entry: dict[str, Any], task: str, encoded: str) -> None:
    """The entry, read back from its JSON, scores its own answer 1 (when it has one)."""
    if not isinstance(entry.get("answer"), str):
        return
    back = decode_entry({ENTRY_KEY: encoded}, data_source_of(task))
    score = dataset.score_answer(back["answer"], back)
    if score != 1.0:
        raise ValueError(
            f"task {task!r}: its scorer gives its own answer {score} (not 1) on the entry read back "
            f"from JSON (question {entry['question'][:80]!r}): it cannot be scored from the row; "
            "leave it out of the mix"
        )


def _draw(spec: TaskSpec, config: dict[str, Any], wanted: dict[str, int], seed: int) -> dict[str, list]:
    """``wanted[split]`` distinct entries of one task, held-out first (see the module docstring)."""
    rg = import_reasoning_gym()
    limit = DRAWS_PER_ROW * sum(wanted.values())
    try:
        dataset = rg.create_dataset(spec.name, seed=_task_seed(seed, spec.name), size=limit, **config)
    except (TypeError, AssertionError, ValueError) as exc:
        raise ValueError(f"task {spec.name!r}: its config {config} is not valid: {exc}") from exc
    out: dict[str, list] = {s: [] for s in SPLITS}
    seen: set[str] = set()
    split_iter = iter([s for s in SPLITS for _ in range(wanted[s])])
    split = next(split_iter, None)
    for idx in range(limit):
        if split is None:
            break
        entry = dataset[idx]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        encoded = encode_entry(entry)
        _check_round_trip(dataset, entry, spec.name, encoded)
        out[split].append((entry, encoded))
        split = next(split_iter, None)
    if split is not None:
        raise ValueError(
            f"task {spec.name!r} gave {len(seen)} distinct questions in {limit} draws, fewer than the "
            f"{sum(wanted.values())} asked ({wanted['train']} train + {wanted['test']} held-out): lower "
            "its weight or the sizes, or widen its config"
        )
    return out


def build_rows(mix: TaskMix) -> dict[str, list[dict[str, Any]]]:
    """The rows of both splits (``"train"``, ``"test"``), each in a seeded shuffle."""
    weights = [t.weight for t in mix.tasks]
    counts = {s: split_counts(getattr(mix, s), weights) for s in SPLITS}
    system = _system_messages(mix.system_prompt)
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for i, spec in enumerate(mix.tasks):
        config = task_config(spec)
        drawn = _draw(spec, config, {s: counts[s][i] for s in SPLITS}, mix.seed)
        for split in SPLITS:
            for entry, encoded in drawn[split]:
                answer = entry.get("answer")
                rows[split].append(
                    {
                        "data_source": data_source_of(spec.name),
                        "prompt": [*system, {"role": "user", "content": entry["question"]}],
                        "ability": "reasoning",
                        "reward_model": {
                            "style": "rule",
                            "ground_truth": "" if answer is None else str(answer),
                        },
                        "extra_info": {
                            "split": split,
                            "index": 0,
                            "task": spec.name,
                            ENTRY_KEY: encoded,
                            CONFIG_KEY: json.dumps(config, sort_keys=True),
                            FORMAT_KEY: mix.answer_format,
                        },
                    }
                )
    for k, split in enumerate(SPLITS):
        random.Random(mix.seed * 2 + k).shuffle(rows[split])
        for index, row in enumerate(rows[split]):
            row["extra_info"]["index"] = index
    return rows


def write_task_mix(mix: TaskMix, out_url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Write ``train.parquet`` and ``test.parquet`` of ``mix`` under ``out_url`` (a directory or an
    fsspec URL); returns their URLs and the rows per task and split."""
    rows = build_rows(mix)
    tables = {s: pa.Table.from_pylist(rows[s]) for s in SPLITS}
    written: dict[str, Any] = {"counts": {t.name: {s: 0 for s in SPLITS} for t in mix.tasks}}
    for split in SPLITS:  # held-out first: a train file is never there without its held-out file
        buf = io.BytesIO()
        pq.write_table(tables[split], buf)
        url = storage.join(out_url, f"{split}.parquet")
        storage.write_bytes_atomic(url, buf.getvalue(), storage_options)
        written[split] = url
        for row in rows[split]:
            written["counts"][row["extra_info"]["task"]][split] += 1
    return written
