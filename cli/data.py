"""``ppoflow data SOURCE ...``: training files written from a task library (reasoning-gym), by
:mod:`ppoflow.infra.datasets`. Bad input is one line on stderr naming the problem and the fix,
exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml
from pydantic import ValidationError

__all__ = ["add_data_command", "cmd_data", "parse_task"]


def parse_task(text: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:WEIGHT`` -> a task spec's fields."""
    name, sep, weight = text.partition(":")
    if not name or (sep and not weight):
        raise argparse.ArgumentTypeError(f"{text!r}: write a task as NAME or NAME:WEIGHT")
    try:
        return {"name": name, **({"weight": float(weight)} if sep else {})}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the weight after ':' is not a number") from None


def _key_value(text: str) -> tuple[str, str, Any]:
    """``TASK.KEY=VALUE`` (VALUE read as YAML) -> (task, key, value)."""
    head, sep, value = text.partition("=")
    task, dot, key = head.partition(".")
    if not (sep and dot and task and key):
        raise argparse.ArgumentTypeError(f"{text!r}: write it as TASK.KEY=VALUE")
    return task, key, yaml.safe_load(value)


def _level(text: str) -> tuple[str, int]:
    task, sep, level = text.partition("=")
    if not (sep and task and level.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: write it as TASK=LEVEL (a level is 0, 1, ...)")
    return task, int(level)


def _configure_reasoning_gym(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory or fsspec URL for train.parquet and test.parquet")
    p.add_argument(
        "--spec", help="a YAML task mix (tasks, train, test, seed, system_prompt); flags override it"
    )
    p.add_argument(
        "--task",
        action="append",
        type=parse_task,
        default=[],
        metavar="NAME[:WEIGHT]",
        help="a reasoning-gym task and its share of the rows (repeat for a mix)",
    )
    p.add_argument("--config", action="append", type=_key_value, default=[], metavar="TASK.KEY=VALUE")
    p.add_argument("--level", action="append", type=_level, default=[], metavar="TASK=LEVEL")
    p.add_argument("--train", type=int, help="rows of train.parquet")
    p.add_argument("--test", type=int, help="rows of test.parquet (the held-out file)")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--system-prompt", help="a reasoning_gym SYSTEM_PROMPTS name or the text; 'none': no system message"
    )
    p.add_argument(
        "--answer-format",
        choices=["tags", "tags_or_last_number"],
        help="where the reward finds the answer: <answer> tags (default), or those else the last number",
    )
    p.set_defaults(run=run_reasoning_gym)


def _mix_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if args.spec:
        with open(args.spec) as f:
            fields = yaml.safe_load(f) or {}
        if not isinstance(fields, dict):
            raise ValueError(f"--spec {args.spec}: expected a mapping (tasks, train, test, seed)")
    if args.task:
        fields["tasks"] = list(args.task)
    for key in ("train", "test", "seed"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    if args.answer_format is not None:
        fields["answer_format"] = args.answer_format
    if args.system_prompt is not None:
        fields["system_prompt"] = None if args.system_prompt == "none" else args.system_prompt
    tasks = {t["name"]: t for t in fields.get("tasks", [])}
    for flag, items in (("--config", args.config), ("--level", args.level)):
        for item in items:
            if item[0] not in tasks:
                raise ValueError(
                    f"{flag} names task {item[0]!r}, which is not in the mix ({', '.join(tasks)})"
                )
    for task, key, value in args.config:
        tasks[task].setdefault("config", {})[key] = value
    for task, level in args.level:
        tasks[task]["level"] = level
    return fields


def run_reasoning_gym(args: argparse.Namespace) -> int:
    from ppoflow.infra.datasets.reasoning_gym import TaskMix, write_task_mix

    try:
        mix = TaskMix.model_validate(_mix_fields(args))
    except ValidationError as exc:
        print(f"reasoning-gym: {exc}", file=sys.stderr)
        return 2
    written = write_task_mix(mix, args.out)
    for task, counts in written["counts"].items():
        print(f"reasoning_gym/{task}: {counts['train']} train, {counts['test']} held-out")
    print(f"train: {written['train']}\nheld-out: {written['test']}")
    return 0


def add_data_command(sub: Any) -> None:
    """``ppoflow data SOURCE``, on the CLI's sub-parsers."""
    data = sub.add_parser(
        "data",
        help="write training files from a task library (reasoning-gym)",
        description="Write veRL-format train/held-out parquet files from a task library (docs/tasks.md).",
    )
    sources = data.add_subparsers(dest="data_command", metavar="SOURCE", required=True)
    p = sources.add_parser(
        "reasoning-gym",
        help="reasoning-gym tasks (or a weighted mix) as train/held-out parquet",
        description=(
            "Write reasoning-gym tasks as veRL-format train.parquet and test.parquet, with no "
            "question in both; rows score with each task's own scorer (docs/tasks.md)."
        ),
    )
    _configure_reasoning_gym(p)


def cmd_data(args: argparse.Namespace) -> int:
    """Run the data command ``args`` holds; what is wrong with its input is one line on stderr
    (naming the problem and the fix) and exit status 2."""
    try:
        return int(args.run(args))
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"{args.data_command}: {exc}", file=sys.stderr)
        return 2
