"""Training data that grows: ``data.train_files`` entries as files, directories or globs, and the
files an experiment has read.

An entry of ``data.train_files`` is a parquet file, a directory (its ``*.parquet`` files) or a
glob (``s3://bucket/prompts/*.parquet``) on any fsspec URL. At the start of a run the entries are
expanded (:func:`expand_train_files`) and compared with the files the experiment has read
(``Manifest.data_files``: one record per file, ``{url, rows, bytes, xxh3, joined}``):

- the files read before keep their place in the data stream, and each must hold exactly the
  bytes it held when it was read: a changed or vanished file is a :class:`DataError` naming it;
- the files that are new join the stream after them, by name, and the run's first iteration starts
  a new epoch that visits the new rows first (``DataCursor.fresh``), then the others.

What a run resolved is written once, before its first iteration, to ``data/runs/<run>.json`` and
``data/after/<iteration>.json``: a retried attempt of the same flow run, and any run that starts
after the same committed iteration (a rerun of a failed run), reads that record instead of listing
again, so it trains on exactly the files (and rows) the first attempt saw, even when more files
arrived in between (those join at the first run after the next commit). Every commit stores the
run's file records in the manifest. A new file that fails to read leaves no record: fix or remove
it and run again.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ppoflow.infra.data import storage
from ppoflow.infra.data.hashing import hash_bytes
from ppoflow.infra.data.prompts import DataCursor, DataError, PromptDataset

__all__ = [
    "expand_train_files",
    "DataStream",
    "open_stream",
    "new_files",
    "run_record_url",
    "after_record_url",
]

_GLOB = ("*", "?", "[")


def _url(protocol: str, path: str) -> str:
    return path if protocol == "file" else f"{protocol}://{path}"


def expand_train_files(entries: list[str], storage_options: dict | None = None) -> list[str]:
    """The parquet files ``entries`` name, each entry's in name order (duplicates dropped).

    A glob entry expands to its matches, a directory to its ``*.parquet`` files; any other entry
    is taken as a file (a missing one is reported when it is read). An entry that matches nothing
    raises :class:`DataError`."""
    out: list[str] = []
    for entry in entries:
        protocol = storage.protocol_of(entry)
        fs, path = storage.url_to_fs(entry, storage_options)
        if not storage.is_local(fs):
            fs.invalidate_cache()
        if any(c in entry for c in _GLOB):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not found:
                raise DataError(
                    f"data.train_files entry {entry!r} matches no file; check the pattern, or drop "
                    "the entry until its files arrive"
                )
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if p.endswith(".parquet"))
            if not found:
                raise DataError(
                    f"data.train_files entry {entry!r} is a directory with no .parquet file; put "
                    "the prompt files in it or name the files"
                )
        else:
            out.append(entry)
            continue
        out += [_url(protocol, p) for p in found]
    return list(dict.fromkeys(out))


def run_record_url(root: str, run_key: str) -> str:
    """``data/runs/<run>.json`` of the experiment at ``root``: what run ``run_key`` reads."""
    return storage.join(root, "data", "runs", f"{run_key}.json")


def after_record_url(root: str, iteration: int) -> str:
    """``data/after/<iteration>.json``: what the runs that start after ``iteration`` read."""
    return storage.join(root, "data", "after", f"{iteration:06d}.json")


def new_files(
    entries: list[str], read: list[dict[str, Any]], storage_options: dict | None = None
) -> list[str]:
    """The files ``entries`` name that are not among the records ``read`` (``ppoflow status``)."""
    known = {r["url"] for r in read}
    return [u for u in expand_train_files(entries, storage_options) if u not in known]


def _read(url: str, storage_options: dict | None) -> tuple[bytes, pa.Table]:
    try:
        data = storage.read_bytes(url, storage_options)
    except FileNotFoundError:
        raise DataError(
            f"prompt file {url} not found (data.train_files); check the path, relative paths "
            "resolve against the flow's working directory"
        ) from None
    try:
        return data, pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"prompt file {url} is not a readable parquet file: {exc}") from None


@dataclass
class DataStream:
    """The files a run trains on (records in stream order), its dataset, and where the rows new
    to the experiment start (``fresh``: a row index of the dataset; None when nothing joined)."""

    records: list[dict[str, Any]]
    dataset: PromptDataset
    fresh: int | None
    after: int  # the iteration the run started after

    def start_cursor(self, cursor: DataCursor, iteration: int) -> DataCursor:
        """The cursor the run's first iteration starts from: a new epoch that visits the new rows
        first when files joined at this run's start (``iteration`` is the manifest's), else
        ``cursor``."""
        if self.fresh is None or iteration != self.after:
            return cursor
        return DataCursor(epoch=int(cursor.get("epoch", 0)) + 1, offset=0, fresh=self.fresh)


def _vanished(url: str) -> DataError:
    return DataError(
        f"{url} was trained on by this experiment but is no longer in data.train_files (or no "
        "longer exists); restore it, or start a new experiment (storage.experiment) without it"
    )


def _verify(record: dict[str, Any], data: bytes) -> None:
    if (len(data), hash_bytes(data)) != (record["bytes"], record["xxh3"]):
        raise DataError(
            f"{record['url']} changed after the experiment read it (at iteration {record['joined']}: "
            f"{record['rows']} rows, {record['bytes']} bytes, xxh3 {record['xxh3']}; now {len(data)} "
            "bytes). A file once trained on must keep its bytes: restore it and put new rows in a "
            "new file"
        )


def open_stream(
    cfg: Any, root: str, run_key: str, iteration: int, read: list[dict[str, Any]], tokenizer: Any = None
) -> DataStream:
    """The data stream of run ``run_key`` of the experiment at ``root`` (``cfg``: its config),
    which starts after ``iteration`` with the files ``read`` before it (``Manifest.data_files``):
    the run's record when it has one (a retried attempt), else the record made and written now
    (see the module docstring). Every file is read and checked against its record. ``tokenizer``:
    needed when ``data.filter_overlong_prompts`` is on."""
    options = cfg.storage.storage_options or None
    record_urls = [run_record_url(root, run_key), after_record_url(root, iteration)]
    saved_url = next((u for u in record_urls if storage.exists(u)), None)
    if saved_url is not None:
        saved = storage.read_json(saved_url)
        records, after, known = saved["files"], int(saved["after"]), int(saved["known"])
        urls = [r["url"] for r in records]
    else:
        records, after = [dict(r) for r in read], iteration
        known = len(records)
        listed = expand_train_files(cfg.data.train_files, options)
        gone = [r["url"] for r in records if r["url"] not in listed]
        if gone:
            raise _vanished(gone[0])
        fresh_urls = [u for u in listed if u not in {r["url"] for r in records}]
        urls = [r["url"] for r in records] + fresh_urls
    tables = []
    for i, url in enumerate(urls):
        if i < len(records) and not storage.exists(url, options):
            raise _vanished(url)
        data, table = _read(url, options)
        if i < len(records):
            _verify(records[i], data)
        else:
            rec = {"url": url, "rows": table.num_rows, "bytes": len(data), "xxh3": hash_bytes(data)}
            records.append({**rec, "joined": iteration + 1})
        tables.append(table)
    for url in record_urls:
        if not storage.exists(url):
            storage.write_json_atomic(url, {"run": run_key, "after": after, "known": known, "files": records})
    dataset = PromptDataset.from_tables(
        urls,
        tables,
        prompt_key=cfg.data.prompt_key,
        require_ground_truth=cfg.reward.rule,
    )
    if cfg.data.filter_overlong_prompts:
        dataset.filter_overlong(
            tokenizer,
            prompt_length=cfg.rollout.prompt_length,
            apply_chat_template=cfg.data.apply_chat_template,
        )
    known_rows = sum(int(r["rows"]) for r in records[:known])
    fresh = dataset.rows_before(known_rows) if 0 < known < len(records) else None
    return DataStream(records=records, dataset=dataset, fresh=fresh, after=after)
