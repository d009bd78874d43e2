"""Training prompts: parquet files in veRL's format, batched in a resumable deterministic order.

Each row has:
    prompt        list of chat messages ``[{"role": "user", "content": "..."}]`` (or a string)
                  (the column name is ``data.prompt_key``)
    data_source   str: picks the rule that scores the row (ppoflow.infra.rewards)
    reward_model  {"ground_truth": ..., "style": "rule"}   (needed for rule rewards)
    extra_info    dict (optional), passed to reward functions

Order: epoch ``e`` visits the rows in ``permutation(seed, e)`` (or in file order without
shuffling). A batch takes the next ``batch_size`` rows from the cursor ``{epoch, offset}`` and
continues into the next epoch when one ends, so every batch is full and the cursor after a batch
resumes exactly where it stopped: batch k of a run that was interrupted and resumed is batch k
of a run that never stopped.

Tokenization: the tokenizer's chat template (``data.apply_chat_template``) with the generation
prompt, then left padding to ``rollout.prompt_length``. A longer prompt is handled by
``data.truncation`` (veRL's names):

    left   (the default) drop its first tokens, so the end of the prompt and the generation
           prompt stay; counted in the batch's stats and logged as a warning
    right  keep its first ``prompt_length`` tokens (the generation prompt may be cut off)
    error  raise :class:`DataError` naming the file, the row and its length

``data.filter_overlong_prompts`` instead drops such rows from the dataset when it is loaded
(:meth:`PromptDataset.filter_overlong`): every prompt is tokenized once per run, a cost that
grows with the dataset (a few seconds per 10k rows on one core). Dropping rows renumbers the
rest, so switching it on or off in the middle of an experiment changes which prompts later
batches hold.

    ds = PromptDataset(cfg.data.train_files, prompt_key=cfg.data.prompt_key)
    rows, next_cursor = ds.take({"epoch": 0, "offset": 0}, 16, seed=0, shuffle=True)
    proto, stats = ds.tokenize(rows, tokenizer, prompt_length=64, apply_chat_template=True)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NotRequired

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from typing_extensions import TypedDict  # pydantic validates it on Python 3.11 too

from ppoflow.infra.data import storage

__all__ = [
    "PromptDataset",
    "DataError",
    "Row",
    "DataCursor",
    "TRUNCATION",
    "prompt_token_ids",
    "ground_truth_of",
]

#: The values of ``data.truncation``.
TRUNCATION = ("error", "left", "right")


class DataCursor(TypedDict):
    """Where the next prompt batch starts: row ``offset`` of ``epoch``'s visiting order.
    ``fresh``: the epoch visits rows ``fresh..`` (rows new to the experiment) before the others
    (:mod:`ppoflow.infra.data.stream`)."""

    epoch: int
    offset: int
    fresh: NotRequired[int]


_LOG = logging.getLogger("ppoflow.data")


class DataError(ValueError):
    """The prompt files are missing, unreadable or lack a required column."""


@dataclass(frozen=True)
class Row:
    """One selected prompt: its epoch and its index in the concatenated files."""

    epoch: int
    index: int

    @property
    def uid(self) -> str:
        """The prompt's id within the experiment: equal for the ``n`` responses to one prompt."""
        return f"{self.epoch}-{self.index}"


class PromptDataset:
    """The rows of one or more veRL-format parquet files (see the module docstring)."""

    def __init__(
        self,
        files: list[str],
        *,
        prompt_key: str = "prompt",
        require_ground_truth: bool = True,
        storage_options: dict | None = None,
        role: str = "data.train_files",
        tables: list[pa.Table] | None = None,
    ):
        if not files:
            raise DataError(f"{role} is empty: list at least one parquet file")
        self.role = role
        if tables is None:
            tables = [self._read(url, storage_options, role) for url in files]
        for url, table in zip(files, tables):
            required = [prompt_key, "data_source"] + (["reward_model"] if require_ground_truth else [])
            missing = [c for c in required if c not in table.column_names]
            if missing:
                raise DataError(
                    f"{url}: missing column(s) {missing}; found {table.column_names}. veRL's format "
                    f"needs '{prompt_key}' (chat messages, or set data.prompt_key), 'data_source' and "
                    f"'reward_model' ({{'ground_truth': ..., 'style': 'rule'}})"
                )
        keep = [prompt_key, "data_source", "reward_model", "extra_info"]
        tables = [t.select([c for c in keep if c in t.column_names]) for t in tables]
        try:
            self.table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise DataError(f"{role} {files}: the files' columns do not agree: {exc}") from None
        if self.table.num_rows == 0:
            raise DataError(f"{role} {files} hold no rows")
        self.files, self.prompt_key = list(files), prompt_key
        self._starts = np.cumsum([0] + [t.num_rows for t in tables])
        self._origin = np.arange(self.table.num_rows)  # row -> row of the concatenated files

    @classmethod
    def from_tables(cls, files: list[str], tables: list[pa.Table], **kwargs: Any) -> PromptDataset:
        """The dataset of ``files`` whose tables were read already (in the same order)."""
        return cls(files, tables=tables, **kwargs)

    def rows_before(self, origin: int) -> int:
        """How many of this dataset's rows come from the first ``origin`` rows of the files."""
        return int(np.searchsorted(self._origin, origin))

    def where(self, index: int) -> str:
        """``"<file> row <i>"``: where row ``index`` (of this dataset) comes from."""
        origin = int(self._origin[index])
        k = int(np.searchsorted(self._starts, origin, side="right")) - 1
        return f"{self.files[k]} row {origin - int(self._starts[k])}"

    @staticmethod
    def _read(url: str, storage_options: dict | None, role: str) -> pa.Table:
        try:
            fs, path = storage.url_to_fs(url, storage_options)
            with fs.open(path, "rb") as f:
                return pq.read_table(f)
        except FileNotFoundError:
            raise DataError(
                f"prompt file {url} not found ({role}); check the path, "
                f"relative paths resolve against the flow's working directory"
            ) from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"prompt file {url} is not a readable parquet file: {exc}") from None

    def __len__(self) -> int:
        return self.table.num_rows

    # ------------------------------------------------------------------ order
    def order(self, epoch: int, seed: int, shuffle: bool, fresh: int | None = None) -> np.ndarray:
        """Row indices of ``epoch`` in visiting order (a function of seed, epoch and ``fresh``
        only). ``fresh``: rows ``fresh..`` come first (each part permuted on its own)."""
        n = len(self)
        if fresh is not None and 0 < fresh < n:
            if not shuffle:
                return np.concatenate([np.arange(fresh, n), np.arange(fresh)])
            rng = np.random.default_rng([int(seed), int(epoch), int(fresh)])
            return np.concatenate([fresh + rng.permutation(n - fresh), rng.permutation(fresh)])
        if not shuffle:
            return np.arange(n)
        return np.random.default_rng([int(seed), int(epoch)]).permutation(n)

    def take(
        self, cursor: DataCursor, batch_size: int, *, seed: int, shuffle: bool
    ) -> tuple[list[Row], DataCursor]:
        """The next ``batch_size`` rows from ``cursor`` and the cursor after them."""
        epoch, offset = int(cursor.get("epoch", 0)), int(cursor.get("offset", 0))
        fresh = cursor.get("fresh")
        if offset >= len(self):  # the files shrank since the cursor was written
            epoch, offset, fresh = epoch + 1, 0, None
        rows: list[Row] = []
        while len(rows) < batch_size:
            order = self.order(epoch, seed, shuffle, fresh)
            step = min(batch_size - len(rows), len(self) - offset)
            rows += [Row(epoch, int(i)) for i in order[offset : offset + step]]
            offset += step
            if offset == len(self):
                epoch, offset, fresh = epoch + 1, 0, None
        after = DataCursor(epoch=epoch, offset=offset)
        if fresh is not None:
            after["fresh"] = int(fresh)
        return rows, after

    # ------------------------------------------------------------------ tokens
    def records(self, rows: list[Row]) -> list[dict[str, Any]]:
        """The selected rows as Python dicts (in ``rows`` order)."""
        return self.table.take(pa.array([r.index for r in rows], type=pa.int64())).to_pylist()

    def prompt_tokens(self, prompt: Any, tokenizer: Any, apply_chat_template: bool) -> list[int]:
        """The token ids of one prompt as the rollout sees it (chat template, no padding)."""
        return prompt_token_ids(
            prompt, tokenizer, apply_chat_template=apply_chat_template, key=self.prompt_key
        )

    def filter_overlong(self, tokenizer: Any, *, prompt_length: int, apply_chat_template: bool) -> int:
        """Drop the rows whose prompt is longer than ``prompt_length`` tokens (tokenizing every
        row once); returns how many were dropped. :class:`DataError` if none is left."""
        prompts = self.table.column(self.prompt_key).to_pylist()
        keep = np.array(
            [len(self.prompt_tokens(p, tokenizer, apply_chat_template)) <= prompt_length for p in prompts],
            dtype=bool,
        )
        if not keep.any():
            raise DataError(
                f"data.filter_overlong_prompts=true dropped every row of {self.files}: no prompt fits "
                f"rollout.prompt_length={prompt_length} tokens; raise rollout.prompt_length"
            )
        dropped = int((~keep).sum())
        if dropped:
            self.table = self.table.filter(pa.array(keep))
            self._origin = self._origin[keep]
            _LOG.warning(
                "data.filter_overlong_prompts: dropped %d of %d prompts longer than rollout.prompt_length=%d",
                dropped,
                len(keep),
                prompt_length,
            )
        return dropped

    def tokenize(
        self,
        rows: list[Row],
        tokenizer: Any,
        *,
        prompt_length: int,
        apply_chat_template: bool,
        meta_info: dict | None = None,
        truncation: str = "left",
    ):
        """A left-padded prompt DataProto for ``rows`` and stats ``{truncated, max_prompt_tokens}``.

        Columns: ``input_ids``, ``attention_mask``, ``position_ids`` (B, prompt_length) and
        non-tensor ``data_source``, ``ground_truth``, ``extra_info``, ``uid``, ``raw_prompt``.
        ``truncation``: what happens to a longer prompt (``left``, ``right``, ``error``; see the
        module docstring).
        """
        from ppoflow.infra.data.dataproto import DataProto

        if truncation not in TRUNCATION:
            raise DataError(f"data.truncation={truncation!r}: expected one of {', '.join(TRUNCATION)}")
        pad_id = _pad_id(tokenizer)
        recs = self.records(rows)
        # A generator: each prompt is tokenized when the one before it has been placed.
        prompts = (self.prompt_tokens(rec[self.prompt_key], tokenizer, apply_chat_template) for rec in recs)
        ids, mask, stats = self._left_padded(rows, prompts, pad_id, prompt_length, truncation)
        position_ids = torch.clamp(torch.cumsum(mask, dim=1) - 1, min=0)
        non_tensors = {
            "data_source": [str(r["data_source"]) for r in recs],
            "ground_truth": [ground_truth_of(r) for r in recs],
            "extra_info": [r.get("extra_info") for r in recs],
            "uid": [row.uid for row in rows],
            "raw_prompt": [r[self.prompt_key] for r in recs],
        }
        proto = DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
            non_tensors=non_tensors,
            meta_info=dict(meta_info or {}),
        )
        return proto, stats

    def _left_padded(
        self,
        rows: list[Row],
        prompts: Iterable[list[int]],
        pad_id: int,
        prompt_length: int,
        truncation: str,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """The (B, prompt_length) ids and attention mask of ``prompts`` (the token ids of ``rows``,
        in order), left-padded with ``pad_id``, longer ones cut as ``truncation`` says (warned
        about once), and the stats ``{truncated, max_prompt_tokens}``."""
        ids = torch.full((len(rows), prompt_length), int(pad_id), dtype=torch.long)
        mask = torch.zeros((len(rows), prompt_length), dtype=torch.long)
        truncated, longest = 0, 0
        for i, toks in enumerate(prompts):
            longest = max(longest, len(toks))
            if len(toks) > prompt_length:
                toks = self._cut(toks, rows[i], prompt_length, truncation)
                truncated += 1
            if toks:
                ids[i, -len(toks) :] = torch.tensor(toks, dtype=torch.long)
                mask[i, -len(toks) :] = 1
        if truncated:
            _LOG.warning(
                "%d of %d prompts were longer than rollout.prompt_length=%d tokens (longest "
                "%d) and lost their %s tokens (data.truncation=%s); raise rollout.prompt_length to keep them",
                truncated,
                len(rows),
                prompt_length,
                longest,
                "first" if truncation == "left" else "last",
                truncation,
            )
        return ids, mask, {"truncated": truncated, "max_prompt_tokens": longest}

    def _cut(self, toks: list[int], row: Row, prompt_length: int, truncation: str) -> list[int]:
        """An overlong prompt's tokens cut to ``prompt_length`` (``left``: its first tokens go,
        ``right``: its last), or DataError naming the row (``error``)."""
        if truncation == "error":
            raise DataError(
                f"{self.where(row.index)}: the prompt has {len(toks)} tokens, more than "
                f"rollout.prompt_length={prompt_length} (data.truncation=error); raise "
                "rollout.prompt_length, set data.truncation=left or right, or set "
                "data.filter_overlong_prompts=true to drop such prompts"
            )
        return toks[-prompt_length:] if truncation == "left" else toks[:prompt_length]


def prompt_token_ids(
    prompt: Any, tokenizer: Any, *, apply_chat_template: bool, key: str = "prompt"
) -> list[int]:
    """The token ids of one prompt (chat messages or a string) as the rollout sees it: the chat
    template with the generation prompt, no special tokens added, no padding. ``key`` names the
    column in errors."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt):
        messages = [{"role": m.get("role"), "content": m.get("content")} for m in prompt]
    else:
        raise DataError(
            f"column '{key}' must hold chat messages "
            f"([{{'role': ..., 'content': ...}}]) or a string; got {type(prompt).__name__}"
        )
    if not apply_chat_template:
        text = "\n".join(str(m["content"]) for m in messages)
    elif getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "data.apply_chat_template=true but the tokenizer has no chat template; "
            "set data.apply_chat_template=false or use a tokenizer with one"
        )
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def ground_truth_of(row: dict[str, Any]) -> Any:
    """A row's ``reward_model.ground_truth`` (a record of the prompt files), or None."""
    rm = row.get("reward_model")
    return rm.get("ground_truth") if isinstance(rm, dict) else None


def _pad_id(tokenizer: Any) -> int:
    """The id prompts are padded with: the pad token's, else the eos token's; DataError if neither."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise DataError("the tokenizer has neither a pad nor an eos token; set one")
    return pad_id
