"""One column of a DataProto <-> one Arrow array and its entry in the file's metadata.

Tensors and numeric arrays become primitive or fixed-shape-tensor columns, bfloat16 as its raw
bits; str/bytes arrays string/binary columns; object arrays go to
:mod:`ppoflow.infra.data.arrow_objects`. The layout, and the file around the columns, is
:mod:`ppoflow.infra.data.arrow_codec`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from ppoflow.infra.data.arrow_objects import encode_objects, object_values

__all__ = ["encode_tensor", "encode_array", "decode_column"]

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


def encode_tensor(t: torch.Tensor) -> tuple[pa.Array, dict]:
    """A tensor of ``batch`` -> ``(column, metadata entry)``; TypeError for unsupported dtypes."""
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


def encode_array(key: str, a: np.ndarray) -> tuple[pa.Array, dict]:
    """An array of ``non_tensor_batch`` -> ``(column, metadata entry)``; TypeError naming ``key``
    for what cannot be stored exactly."""
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
        items = a.reshape(-1).tolist()
        values = pa.array(items, type=pa.string() if a.dtype.kind == "U" else pa.binary())
        return _wrap_rows(values, n, shape, False), {"kind": "ndarray", "dtype": a.dtype.str, "shape": shape}
    if a.dtype.kind == "O":
        values, encoding = encode_objects(key, a.reshape(-1))
        return _wrap_rows(values, n, shape, False), {"kind": "object", "encoding": encoding, "shape": shape}
    raise TypeError(f"non-tensor column {key!r}: numpy dtype {a.dtype} is not supported")


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


def decode_column(col: Any, info: dict, n: int) -> torch.Tensor | np.ndarray:
    """The tensor or array of ``n`` rows that :func:`encode_tensor`/:func:`encode_array` stored as
    ``col`` with metadata entry ``info``."""
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
            for i, item in enumerate(object_values(values, info.get("encoding", "arrow"))):
                out[i] = item
        return out.reshape(shape)
    raise KeyError(f"unknown column kind {kind!r}")
