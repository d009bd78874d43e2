"""Arrow IPC codec for DataProto: one Arrow IPC *file* per DataProto, never pickle.

Layout of a file (format version :data:`FORMAT_VERSION`), one record batch, one column per key,
named by the plain key:

* tensors (``batch``): 1-D tensors as primitive columns; (N, *shape) tensors as
  ``arrow.fixed_shape_tensor`` extension columns with ``shape``. Kept exactly: bool, uint8, int8,
  int16, int32, int64, float16, float32, float64, and bfloat16, which Arrow lacks: its raw bits
  are stored as uint16 and the dtype is restored from the metadata (bit-exact).
* numpy arrays (``non_tensor_batch``): numeric/bool arrays like tensors (dtype kept); str/bytes
  arrays as Arrow string/binary; object arrays of str, lists, dicts, numbers, None as native
  Arrow types (string, list, struct, ...). Where Arrow's inference would not give back exactly
  the same Python values (dicts with differing keys, mixed int/float, ints beyond int64 ...), the
  column holds one JSON string per value instead. Elements that are tuples or numpy arrays come
  back as lists. Arrays with more than one dimension are stored row-wise as fixed-size lists.
* schema metadata ``ppoflow``: JSON ``{"format", "version", "num_rows", "columns": {key: {"group",
  "kind", "dtype", "shape", ...}}}``; ``ppoflow.meta_info``: the JSON of ``meta_info``.

Tensor data moves without Python loops: tensor -> numpy view -> Arrow buffer (zero-copy) on save;
on load local files are memory-mapped and each column is copied once into its own tensor.

This module is the file: the record batch and its metadata, reading and writing it on storage, and
the errors for files that are not DataProtos. The columns are encoded by
:mod:`ppoflow.infra.data.arrow_columns` (object columns by :mod:`ppoflow.infra.data.arrow_objects`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.arrow_columns import decode_column, encode_array, encode_tensor

__all__ = ["DataProtoFormatError", "FORMAT_VERSION", "encode", "decode", "save", "load"]

FORMAT_VERSION = 1
META_KEY = b"ppoflow"
META_INFO_KEY = b"ppoflow.meta_info"
_MAGIC = b"ARROW1"
_FIX = "Write DataProto files with DataProto.save(url) and check that the URL points at one"


class DataProtoFormatError(ValueError):
    """A file is not a DataProto, is truncated or corrupt, or lacks a requested column."""


def encode(
    tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray], meta_info: dict
) -> pa.RecordBatch:
    """Build the Arrow record batch (with ppoflow schema metadata) of a DataProto's parts."""
    arrays, names, columns = [], [], {}
    num_rows = 0
    groups: tuple[tuple[str, dict[str, Any]], ...] = (("batch", tensors), ("non_tensor", non_tensors))
    for group, items in groups:
        for key, value in items.items():
            try:
                arr, info = encode_tensor(value) if group == "batch" else encode_array(key, value)
            except TypeError as exc:
                raise TypeError(f"cannot save column {key!r}: {exc}") from exc
            num_rows = len(value)
            arrays.append(arr)
            names.append(key)
            columns[key] = {"group": group, **info}
    try:
        meta_json = json.dumps(meta_info, allow_nan=True)
    except TypeError as exc:
        raise TypeError(f"meta_info must be JSON-serialisable to be saved: {exc}") from exc
    header = {
        "format": "ppoflow.DataProto",
        "version": FORMAT_VERSION,
        "num_rows": num_rows,
        "columns": columns,
    }
    metadata = {META_KEY: json.dumps(header).encode(), META_INFO_KEY: meta_json.encode()}
    schema = pa.schema([pa.field(k, a.type) for k, a in zip(names, arrays)], metadata=metadata)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _header(url: str, schema: pa.Schema) -> tuple[dict, dict]:
    metadata = schema.metadata or {}
    if META_KEY not in metadata:
        cols = ", ".join(schema.names[:10]) or "none"
        raise DataProtoFormatError(
            f"{url} is an Arrow IPC file but not a ppoflow DataProto: its schema has no 'ppoflow' "
            f"metadata (columns: {cols}). {_FIX}; to import a plain Arrow table, read it with "
            "pyarrow and build DataProto.from_dict(...)."
        )
    try:
        header = json.loads(metadata[META_KEY])
        meta_info = json.loads(metadata.get(META_INFO_KEY, b"{}"))
        version, columns = header["version"], header["columns"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataProtoFormatError(
            f"{url}: the 'ppoflow' schema metadata is corrupt ({exc}). {_FIX}."
        ) from exc
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DataProtoFormatError(
            f"{url} was written in DataProto format version {version}, this ppoflow reads up to "
            f"{FORMAT_VERSION}. Upgrade ppoflow to read it."
        )
    missing = [k for k in columns if k not in schema.names]
    if missing:
        raise DataProtoFormatError(
            f"{url}: columns {missing} are in the metadata but not in the file. {_FIX}."
        )
    return header, meta_info


def decode(
    url: str, table: pa.Table | pa.RecordBatch, header: dict, meta_info: dict, columns: list[str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict]:
    """Rebuild ``(tensors, non_tensors, meta_info)`` from a table written by :func:`encode`."""
    n = header.get("num_rows", table.num_rows)
    if table.num_columns and table.num_rows != n:
        raise DataProtoFormatError(
            f"{url}: has {table.num_rows} rows, its metadata says {n}; the file is corrupt. {_FIX}."
        )
    tensors: dict[str, Any] = {}  # decode_column's tensors and arrays, by group
    non_tensors: dict[str, Any] = {}
    for key in columns if columns is not None else header["columns"]:
        info = header["columns"][key]
        try:
            value = decode_column(table.column(key), info, n)
        except (pa.ArrowException, KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise DataProtoFormatError(
                f"{url}: column {key!r} cannot be decoded ({exc}); the file is corrupt. {_FIX}."
            ) from exc
        (tensors if info.get("group") == "batch" else non_tensors)[key] = value
    return tensors, non_tensors, meta_info


# ----------------------------------------------------------------------------- files


def save(
    url: str,
    tensors: dict[str, torch.Tensor],
    non_tensors: dict[str, np.ndarray],
    meta_info: dict,
    storage_options: dict | None = None,
    compression: str | None = None,
) -> None:
    """Write one Arrow IPC file at ``url`` atomically (see :func:`ppoflow.infra.data.storage.open_atomic`).

    ``compression`` is None (default: fastest, memory-mappable) or ``"lz4"``/``"zstd"``.
    """
    batch = encode(tensors, non_tensors, meta_info)
    options = ipc.IpcWriteOptions(compression=compression)
    fs, path = storage.url_to_fs(url, storage_options)
    with contextlib.ExitStack() as stack:
        if storage.is_local(fs):  # a native file: pyarrow writes the buffers without Python calls
            sink = stack.enter_context(pa.OSFile(stack.enter_context(storage.atomic_local_path(path)), "wb"))
        else:
            sink = stack.enter_context(storage.open_atomic(url, storage_options))
        with ipc.new_file(sink, batch.schema, options=options) as writer:
            writer.write_batch(batch)


def _open_error(url: str, head: bytes, exc: Exception) -> DataProtoFormatError:
    if head.startswith(_MAGIC):
        problem = (
            f"it is an Arrow IPC file that is truncated or corrupt ({exc}); rewrite it with DataProto.save()"
        )
        return DataProtoFormatError(f"{url} cannot be read as a DataProto: {problem}.")
    return DataProtoFormatError(
        f"{url} is not a ppoflow DataProto file: it is not an Arrow IPC file ({exc}). {_FIX}."
    )


def _read(url: str, source: Any, head: bytes, columns: list[str] | None, ranged: bool = False):
    """Open ``source`` as an IPC file, check it is a DataProto and decode (some of) it.

    ``ranged``: reopen the file reading only the chosen columns' buffers (remote files).
    """
    try:
        reader = ipc.open_file(source)
    except (pa.ArrowException, OSError) as exc:
        raise _open_error(url, head, exc) from exc
    header, meta_info = _header(url, reader.schema)
    if columns is not None:
        missing = [c for c in columns if c not in header["columns"]]
        if missing:
            available = ", ".join(header["columns"]) or "none"
            raise DataProtoFormatError(
                f"{url}: the DataProto has no column(s) {', '.join(map(repr, missing))} "
                f"(available: {available}). Pass columns= from the available keys, or None for all."
            )
        if not columns:  # meta_info only: the footer is all we need
            return {}, {}, meta_info
        if ranged:
            fields = sorted(reader.schema.get_field_index(c) for c in columns)
            reader = ipc.open_file(source, options=ipc.IpcReadOptions(included_fields=fields))
    try:
        table = reader.read_all()
    except (pa.ArrowException, OSError) as exc:
        raise _open_error(url, head, exc) from exc
    return decode(url, table, header, meta_info, columns)


def load(
    url: str, columns: Iterable[str] | None = None, storage_options: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict]:
    """Read ``(tensors, non_tensors, meta_info)`` from the DataProto file at ``url``.

    Local files are memory-mapped (only the requested columns are paged in); remote files are
    fetched whole, or with ``columns=`` only the byte ranges of those columns.
    Raises :class:`DataProtoFormatError` for files that are not DataProtos, truncated files and
    missing columns; ``FileNotFoundError`` when nothing exists at ``url``.
    """
    columns = [columns] if isinstance(columns, str) else None if columns is None else list(columns)
    fs, path = storage.url_to_fs(url, storage_options)
    if storage.is_local(fs):
        with pa.memory_map(path, "r") as source:
            head = source.read(len(_MAGIC))
            source.seek(0)
            return _read(url, source, head, columns)
    if columns is None:
        data = fs.cat_file(path)
        return _read(url, pa.BufferReader(data), data[: len(_MAGIC)], None)
    # Ranged reads: the footer, then only the chosen columns' buffers (small read-ahead blocks
    # instead of s3fs's 50 MiB default, which would fetch the whole file).
    kwargs = {"cache_type": "readahead", "block_size": 1 << 20} if storage.is_s3(fs) else {}
    with fs.open(path, "rb", **kwargs) as f:
        head = f.read(len(_MAGIC))
        return _read(url, f, head, columns, ranged=True)
