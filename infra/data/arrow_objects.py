"""Object columns of a DataProto's ``non_tensor_batch`` <-> Arrow arrays, exactly or not at all.

The encodings are tried in order, and the first whose values decode to exactly the same Python
values wins: Arrow's own inference (string, list, struct, ...), an Arrow map (dicts with differing
keys), one JSON string per value. A value none of them keeps raises TypeError naming it. The
layout is described in :mod:`ppoflow.infra.data.arrow_codec`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["encode_objects", "object_values"]


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


def object_values(arr: pa.Array, encoding: str) -> list:
    """Python values of an object column's flat Arrow values (inverse of :func:`encode_objects`)."""
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


def encode_objects(key: str, flat: np.ndarray) -> tuple[pa.Array, str]:
    """Encode a 1-D object array natively (string, list, struct, map ...) if that round-trips
    exactly, else as one JSON string per value; returns ``(values, encoding)``."""
    values = list(flat)
    if all(type(v) is str for v in values):
        return pa.array(values, type=pa.string()), "arrow"
    plain = [_normalize(v) for v in values]
    for encoding, build in _object_candidates(plain):
        try:
            arr = build()
            if _same(object_values(arr, encoding), plain):
                return arr, encoding
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            continue
    bad = next((v for v, p in zip(values, plain) if not _survives_json(p)), values[0])
    raise TypeError(
        f"non-tensor column {key!r}: value {bad!r:.80} cannot be stored exactly in Arrow or JSON. "
        "Use None, bool, int, float, str, bytes, lists, numpy arrays and dicts with str keys."
    )


def _survives_json(value: Any) -> bool:
    """True when ``value`` alone survives a JSON round trip (to point at the culprit)."""
    try:
        return _same(json.loads(json.dumps(value, allow_nan=True)), value)
    except (TypeError, ValueError, OverflowError):
        return False
