"""The data and reward checks of the preflight (:mod:`ppoflow.infra.preflight`): a sample, not a pass.

Each data file, of ``data.train_files`` and of ``data.val_files`` alike, costs its parquet footer
plus its first :data:`SAMPLE_ROWS` rows (read and, for the prompt lengths, tokenized); the reward
function is called on :data:`REWARD_ROWS` rows of each list, twice each (an empty response, and
the row's ground truth as the response). A problem names the list, the file and the row.

The held-out files are read as the evaluation reads them: each entry is a file (no globs), and
every row is kept, so ``data.filter_overlong_prompts`` does not apply to them: with
``data.truncation=error`` a prompt longer than ``rollout.prompt_length`` is a problem there.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataError, ground_truth_of, prompt_token_ids
from ppoflow.infra.preflight.report import Checks

__all__ = ["check_data", "check_reward", "SAMPLE_ROWS", "REWARD_ROWS"]

#: Rows read and checked from the start of each data file.
SAMPLE_ROWS = 64
#: Sample rows the reward function is called on (twice each).
REWARD_ROWS = 4

#: A row problem: (kind, what is wrong, what the column must hold).
RowProblem = tuple[str, str, str]

_FORMAT = (
    "veRL's format: '{key}' (chat messages [{{'role': 'user', 'content': ...}}] or a string; another "
    "column name goes in data.prompt_key), 'data_source' (a string naming the reward rule) and "
    "'reward_model' ({{'ground_truth': ..., 'style': 'rule'}})"
)


def _sample(url: str, cfg: ExperimentConfig) -> tuple[pa.Schema, int, list[dict[str, Any]]]:
    """(schema, row count, the first SAMPLE_ROWS rows) of one parquet file; DataError if unreadable."""
    keep = (cfg.data.prompt_key, "data_source", "reward_model", "extra_info")
    try:
        fs, path = storage.url_to_fs(url, cfg.storage.storage_options or None)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            columns = [name for name in keep if name in schema.names]
            batch = next(pf.iter_batches(batch_size=SAMPLE_ROWS, columns=columns), None)
            return schema, pf.metadata.num_rows, batch.to_pylist() if batch is not None else []
    except FileNotFoundError:
        raise DataError("the file does not exist") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"not a readable parquet file ({exc})") from None


def _check_schema(
    where: str, field: str, schema: pa.Schema, count: int, cfg: ExperimentConfig, c: Checks
) -> bool:
    """The file's columns and row count (``where``: ``<field>: <url>``)."""
    key, rule = cfg.data.prompt_key, cfg.reward.rule
    need = [key, "data_source"] + (["reward_model"] if rule else [])
    missing = [name for name in need if name not in schema.names]
    fmt = _FORMAT.format(key=key)
    if missing:
        c.problem(
            where, f"missing column(s) {missing}; the file has {schema.names}", f"write the rows in {fmt}"
        )
        return False
    if count == 0:
        c.problem(where, "the file holds no rows", f"remove it from {field} or fill it")
        return False
    if rule:
        kind = schema.field("reward_model").type
        if not (pa.types.is_struct(kind) and kind.get_field_index("ground_truth") >= 0):
            c.problem(
                f"{where} column 'reward_model'",
                f"its type is {kind}, with no 'ground_truth' field (rule rewards read it)",
                f"write the rows in {fmt}, or set reward.rule=false when no rule scores them",
            )
            return False
    return True


def _row_problems(
    row: dict[str, Any], tokenizer: Any, cfg: ExperimentConfig, filtered: bool
) -> tuple[list[RowProblem], int | None]:
    """What is wrong with one sample row, as ``(kind, what, want)`` in report order, and its
    prompt's length in tokens (None without a tokenizer, or when the prompt cannot be tokenized).
    ``filtered``: overlong prompts of this file are dropped (``data.filter_overlong_prompts``)."""
    from ppoflow.infra.rewards import get_reward_fn

    rule, data, key = cfg.reward.rule, cfg.data, cfg.data.prompt_key
    problems: list[RowProblem] = []
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        problems.append(("data_source", f"data_source is {source!r}", "a non-empty string"))
    elif rule and not (cfg.reward.custom_function or cfg.reward.remote):
        try:
            get_reward_fn(source)
        except KeyError as exc:
            problems.append(("reward", str(exc.args[0] if exc.args else exc), ""))
    if rule and ground_truth_of(row) is None:
        problems.append(
            ("ground_truth", "reward_model.ground_truth is missing", "the answer the rule compares with")
        )
    if tokenizer is None:
        return problems, None
    try:
        n = len(
            prompt_token_ids(row.get(key), tokenizer, apply_chat_template=data.apply_chat_template, key=key)
        )
    except DataError as exc:
        problems.append(("prompt", str(exc), "chat messages or a string"))
        return problems, None
    if n > cfg.rollout.prompt_length and data.truncation == "error" and not filtered:
        problems.append(("length", f"the prompt has {n} tokens", ""))
    return problems, n


def _report_kind(
    where: str,
    kind: str,
    what: str,
    want: str,
    longest: int,
    cfg: ExperimentConfig,
    c: Checks,
    filtered: bool,
) -> None:
    """Report one kind of row problem, found first at ``where``; ``filtered``: the file is one
    that ``data.filter_overlong_prompts`` could filter (a training file)."""
    if kind == "length":
        drop = (
            ", or set data.filter_overlong_prompts=true to drop such prompts"
            if filtered
            else " (every held-out prompt is evaluated: data.filter_overlong_prompts does not drop them)"
        )
        c.problem(
            where,
            f"{what}, more than rollout.prompt_length={cfg.rollout.prompt_length} (data.truncation=error)",
            f"raise rollout.prompt_length to at least {longest}, set data.truncation=left or right{drop}",
        )
    elif kind == "reward":
        c.problem(where, what, "")
    else:
        c.problem(
            where, what, f"column '{'reward_model' if kind == 'ground_truth' else kind}' must hold {want}"
        )


def _check_rows(
    where: str, filterable: bool, rows: list[dict[str, Any]], tokenizer: Any, cfg: ExperimentConfig, c: Checks
) -> list[dict[str, Any]]:
    """Per-row checks on the sample; each kind of problem is reported once (its first row, a count).
    ``filterable``: a training file (``data.filter_overlong_prompts`` applies to it). Returns the
    rows without a problem."""
    data, limit = cfg.data, cfg.rollout.prompt_length
    filtered = filterable and data.filter_overlong_prompts
    bad: dict[str, list[tuple[int, str, str]]] = {}
    lengths: list[int] = []
    good: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        problems, n = _row_problems(row, tokenizer, cfg, filtered)
        for kind, what, want in problems:
            bad.setdefault(kind, []).append((i, what, want))
        if not problems:
            good.append(row)
        if n is not None:
            lengths.append(n)
    longest, overlong = max(lengths, default=0), sum(n > limit for n in lengths)
    for kind, found in bad.items():
        i, what, want = found[0]
        more = f" (and {len(found) - 1} more of the first {len(rows)})" if len(found) > 1 else ""
        _report_kind(f"{where} row {i}{more}", kind, what, want, longest, cfg, c, filterable)
    if overlong and not bad.get("length"):
        action = (
            "they will be dropped (data.filter_overlong_prompts)"
            if filtered
            else f"data.truncation={data.truncation} cuts them"
        )
        c.report.notes.append(
            f"{where}: {overlong} of the first {len(rows)} prompts are longer than rollout.prompt_length="
            f"{limit} tokens (longest {longest}); {action}"
        )
    return good


def _data_files(field: str, cfg: ExperimentConfig, c: Checks) -> list[str]:
    """The files of ``data.train_files`` (its globs and directories expanded, as training reads
    them) or of ``data.val_files`` (each entry a file, as the evaluation reads them)."""
    from ppoflow.infra.data.stream import expand_train_files

    if field == "data.val_files":
        return list(dict.fromkeys(cfg.data.val_files))
    try:
        return expand_train_files(cfg.data.train_files, cfg.storage.storage_options or None)
    except DataError as exc:
        c.problem(field, str(exc), "fix the entry")
        return []


def check_data(cfg: ExperimentConfig, tokenizer: Any, c: Checks) -> list[dict[str, Any]]:
    """Check the schema and sample of every file of ``data.train_files`` and ``data.val_files``;
    returns rows for :func:`check_reward`: up to :data:`REWARD_ROWS` of each list's sample rows
    that passed every check."""
    samples: list[dict[str, Any]] = []
    shared = [f for f in cfg.data.val_files if f in cfg.data.train_files]
    if shared:
        c.report.notes.append(
            f"{shared[0]} is in both data.train_files and data.val_files: its held-out score is on "
            "prompts the policy trains on (memory, not learning); if a held-out list went where the "
            "training list was meant, swap them"
        )
    for field in ("data.train_files", "data.val_files"):
        passed: list[dict[str, Any]] = []
        for url in _data_files(field, cfg, c):
            where = f"{field}: {url}"
            try:
                schema, count, rows = _sample(url, cfg)
            except DataError as exc:
                c.problem(
                    where,
                    str(exc),
                    "check the path (a relative path resolves against the working directory) or URL",
                )
                continue
            if not _check_schema(where, field, schema, count, cfg, c):
                continue
            before = len(c.problems)
            passed += _check_rows(where, field == "data.train_files", rows, tokenizer, cfg, c)
            if len(c.problems) == before:
                c.ok(f"data: {where} ({count} rows; schema and the first {len(rows)} rows checked)")
        samples += passed[:REWARD_ROWS]
    return samples


def check_reward(cfg: ExperimentConfig, rows: list[dict[str, Any]], c: Checks) -> None:
    """``reward.custom_function`` imports, and the reward gives finite scores on the sample rows
    (:func:`check_data`'s: a few of each data list)."""
    from ppoflow.infra.rewards import load_custom_function, score_batch

    custom = cfg.reward.custom_function
    if custom:
        try:
            load_custom_function(custom)
        except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, ... all mean the same here
            c.problem(
                f"reward.custom_function={custom!r}",
                f"{type(exc).__name__}: {exc}",
                "name an importable 'package.module:function' or 'path/to/file.py:function'",
            )
            return
    if not (cfg.reward.rule or custom):
        return
    usable = [r for r in rows if isinstance(r.get("data_source"), str)]
    if not usable:
        return
    sources = [r["data_source"] for r in usable] * 2
    truths = [ground_truth_of(r) for r in usable] * 2
    responses = [""] * len(usable) + [str(t) for t in truths[: len(usable)]]
    extras = [r.get("extra_info") for r in usable] * 2
    try:
        score_batch(sources, responses, truths, extras, custom_function=custom)
    except KeyError:
        return  # an unknown data source: reported by the data checks
    except Exception as exc:  # noqa: BLE001 - whatever the user's function raises is the finding
        name = f"reward.custom_function={custom!r}" if custom else "the rule reward of the data source"
        c.problem(
            name,
            f"on sample rows (responses: empty, and the ground truth) {type(exc).__name__}: {exc}",
            "make the reward function return a finite float (or a dict with a finite 'score') "
            "for any response",
        )
        return
    c.ok(f"reward: finite on {len(sources)} sample responses")
