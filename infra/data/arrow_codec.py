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
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from ppoflow.infra.data import storage

__all__ = ["DataProtoFormatError", "FORMAT_VERSION", "encode", "decode", "save", "load"]

FORMAT_VERSION = 1
META_KEY = b"ppoflow"
META_INFO_KEY = b"ppoflow.meta_info"
_MAGIC = b"ARROW1"
_FIX = "Write DataProto files with DataProto.save(url) and check that the URL points at one"

# torch dtype -> (name in the metadata, numpy dtype of the stored values)
_TORCH_DTYPES: dict[torch.dtype, tuple[str, np.dtype]] = {
    dt: (name, np.dtype("uint16" if name == "bfloat16" else name))
    for dt in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )  # fmt: skip
    for name in [str(dt).removeprefix("torch.")]
}
_TORCH_BY_NAME = {name: dt for dt, (name, _) in _TORCH_DTYPES.items()}


class DataProtoFormatError(ValueError):
    """A file is not a DataProto, is truncated or corrupt, or lacks a requested column."""


# ----------------------------------------------------------------------------- encoding


def _wrap_rows(values: pa.Array, n: int, shape: list[int], tensor_like: bool) -> pa.Array:
    """Group flat ``values`` (n * prod(shape)) into n rows of ``shape``."""
    if not shape:
        return values
    width = math.prod(shape)
    if width == 0:
        return pa.nulls(n)  # Arrow has no zero-width lists; shape lives in the metadata
    rows = pa.FixedSizeListArray.from_arrays(values, width)
    if tensor_like:
        return pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(values.type, shape), rows)
    return rows


def _encode_tensor(t: torch.Tensor) -> tuple[pa.Array, dict]:
    if t.dtype not in _TORCH_DTYPES:
        raise TypeError(f"dtype {t.dtype} is not supported (supported: {sorted(_TORCH_BY_NAME)})")
    name, np_dtype = _TORCH_DTYPES[t.dtype]
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        flat = t.view(torch.int16).reshape(-1).numpy().view(np.uint16)
    else:
        flat = t.reshape(-1).numpy()
    shape = list(t.shape[1:])
    arr = _wrap_rows(pa.array(flat), t.shape[0], shape, tensor_like=True)
    return arr, {"kind": "tensor", "dtype": name, "shape": shape}


def _normalize(x: Any) -> Any:
    """Turn tuples/numpy values into the plain Python values they come back as."""
    if isinstance(x, np.ndarray):
        return _normalize(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return [_normalize(v) for v in x]
    if isinstance(x, dict):
        return {k: _normalize(v) for k, v in x.items()}
    return x


def _same(a: Any, b: Any) -> bool:
    """Strict equality of plain values: types must match, NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _object_values(arr: pa.Array, encoding: str) -> list:
    """Python values of an object column's flat Arrow values (inverse of :func:`_encode_objects`)."""
    items = arr.to_pylist()
    if encoding == "json":
        return [json.loads(s) for s in items]
    if encoding == "map":
        return [None if v is None else dict(v) for v in items]
    return items


def _object_candidates(plain: list) -> Iterator[tuple[str, Callable[[], pa.Array]]]:
    """Arrow encodings to try for plain values, in order of preference."""
    yield "arrow", lambda: pa.array(plain)
    dicts = [v for v in plain if v is not None]
    if dicts and all(type(v) is dict for v in dicts):  # dicts with differing keys: a map

        def build_map() -> pa.Array:
            value_type = pa.array([x for d in dicts for x in d.values()]).type
            rows = [None if v is None else list(v.items()) for v in plain]
            return pa.array(rows, pa.map_(pa.string(), value_type))

        yield "map", build_map
    yield "json", lambda: pa.array([json.dumps(v, allow_nan=True) for v in plain], type=pa.string())


def _encode_objects(key: str, flat: np.ndarray) -> tuple[pa.Array, str]:
    """Encode a 1-D object array natively (string, list, struct, map ...) if that round-trips
    exactly, else as one JSON string per value."""
    values = list(flat)
    if all(type(v) is str for v in values):
        return pa.array(values, type=pa.string()), "arrow"
    plain = [_normalize(v) for v in values]
    for encoding, build in _object_candidates(plain):
        try:
            arr = build()
            if _same(_object_values(arr, encoding), plain):
                return arr, encoding
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            continue
    bad = next((v for v, p in zip(values, plain) if not _encode_objects_ok(p)), values[0])
    raise TypeError(
        f"non-tensor column {key!r}: value {bad!r:.80} cannot be stored exactly in Arrow or JSON. "
        "Use None, bool, int, float, str, bytes, lists, numpy arrays and dicts with str keys."
    )


def _encode_objects_ok(value: Any) -> bool:
    """True when ``value`` alone survives a JSON round trip (to point at the culprit)."""
    try:
        return _same(json.loads(json.dumps(value, allow_nan=True)), value)
    except (TypeError, ValueError, OverflowError):
        return False


def _encode_array(key: str, a: np.ndarray) -> tuple[pa.Array, dict]:
    n, shape = a.shape[0], list(a.shape[1:])
    if a.dtype.kind in "biuf":
        if a.dtype.byteorder not in ("=", "|"):
            a = a.astype(a.dtype.newbyteorder("="))
        try:
            pa.from_numpy_dtype(a.dtype)
        except (pa.ArrowNotImplementedError, NotImplementedError) as exc:
            raise TypeError(f"non-tensor column {key!r}: dtype {a.dtype} is not supported") from exc
        flat = np.ascontiguousarray(a).reshape(-1)
        arr = _wrap_rows(pa.array(flat), n, shape, tensor_like=True)
        return arr, {"kind": "ndarray", "dtype": a.dtype.str, "shape": shape}
    if a.dtype.kind in "US":
        flat = a.reshape(-1).tolist()
        values = pa.array(flat, type=pa.string() if a.dtype.kind == "U" else pa.binary())
        return _wrap_rows(values, n, shape, False), {"kind": "ndarray", "dtype": a.dtype.str, "shape": shape}
    if a.dtype.kind == "O":
        values, encoding = _encode_objects(key, a.reshape(-1))
        return _wrap_rows(values, n, shape, False), {"kind": "object", "encoding": encoding, "shape": shape}
    raise TypeError(f"non-tensor column {key!r}: numpy dtype {a.dtype} is not supported")


def encode(
    tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray], meta_info: dict
) -> pa.RecordBatch:
    """Build the Arrow record batch (with ppoflow schema metadata) of a DataProto's parts."""
    arrays, names, columns = [], [], {}
    num_rows = 0
    for group, items in (("batch", tensors), ("non_tensor", non_tensors)):
        for key, value in items.items():
            try:
                arr, info = _encode_tensor(value) if group == "batch" else _encode_array(key, value)
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


# ----------------------------------------------------------------------------- decoding


def _flat_values(col: pa.ChunkedArray | pa.Array, info: dict) -> pa.Array | None:
    """The column's values as one flat Arrow array (None for zero-width rows)."""
    if isinstance(col, pa.ChunkedArray):  # combine_chunks would copy even a single chunk
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    arr = col.storage if isinstance(col, pa.ExtensionArray) else col
    if pa.types.is_null(arr.type) and info.get("shape") and math.prod(info["shape"]) == 0:
        return None
    if pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()
    return arr


def _writable(a: np.ndarray) -> np.ndarray:
    """``a`` itself if torch may own it, else one copy (views over mmap/Arrow are read-only)."""
    return a if a.flags.writeable and a.flags.c_contiguous else np.array(a, copy=True, order="C")


def _decode_column(col: Any, info: dict, n: int) -> torch.Tensor | np.ndarray:
    shape = (n, *info.get("shape", []))
    values = _flat_values(col, info)
    kind = info.get("kind")
    if kind == "tensor":
        torch_dtype = _TORCH_BY_NAME[info["dtype"]]
        np_dtype = _TORCH_DTYPES[torch_dtype][1]
        if values is None:
            return torch.zeros(shape, dtype=torch_dtype)
        flat = _writable(values.to_numpy(zero_copy_only=False).astype(np_dtype, copy=False))
        if torch_dtype == torch.bfloat16:
            return torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(flat).reshape(shape)
    if kind == "ndarray":
        dtype = np.dtype(info["dtype"])
        if values is None:
            return np.zeros(shape, dtype=dtype)
        if dtype.kind in "US":
            return np.array(values.to_pylist(), dtype=dtype).reshape(shape)
        return _writable(values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)).reshape(shape)
    if kind == "object":
        out = np.empty(math.prod(shape), dtype=object)
        if values is not None:
            for i, item in enumerate(_object_values(values, info.get("encoding", "arrow"))):
                out[i] = item
        return out.reshape(shape)
    raise KeyError(f"unknown column kind {kind!r}")


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
    tensors, non_tensors = {}, {}
    for key in columns if columns is not None else header["columns"]:
        info = header["columns"][key]
        try:
            value = _decode_column(table.column(key), info, n)
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
    url: str, columns: list[str] | None = None, storage_options: dict | None = None
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
