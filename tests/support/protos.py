"""Bit-exact equality of DataProto batches, shared by the DataProto and storage tests."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as ints of the same width (bit-exact comparison, NaN-safe)."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def same_values(a, b) -> bool:
    """Strict equality of Python values: types must match, NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(same_values, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    return a == b


def assert_proto_equal(a: DataProto, b: DataProto, meta: bool = True) -> None:
    """Same keys, dtypes, shapes and bit-identical values."""
    assert list(a.batch) == list(b.batch)
    for k in a.batch:
        assert a.batch[k].dtype == b.batch[k].dtype, k
        assert a.batch[k].shape == b.batch[k].shape, k
        assert torch.equal(bits(a.batch[k]), bits(b.batch[k])), k
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for k in a.non_tensor_batch:
        x, y = a.non_tensor_batch[k], b.non_tensor_batch[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        if x.dtype.kind == "O":
            assert same_values(x.tolist(), y.tolist()), (k, x, y)
        else:
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), k
    if meta:
        assert a.meta_info == b.meta_info
