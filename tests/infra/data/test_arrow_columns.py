"""Tensor and array columns (``arrow_columns``): plain Arrow types any Arrow tool reads (fixed-shape
tensors, primitives, bfloat16 as its raw bits), whatever the tensor's memory layout; a dtype that
cannot be stored exactly is refused by name. Object columns: test_arrow_objects.py."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from tests.support.protos import assert_proto_equal, full_proto, saved_table


def test_plain_pyarrow_sees_tensor_and_array_columns(tmp_path):
    table = saved_table(full_proto(), str(tmp_path / "r.arrow"))
    assert table.schema.field("float32").type == pa.fixed_shape_tensor(pa.float32(), [3, 2])
    assert table.schema.field("int64_1d").type == pa.int64()
    assert table.schema.field("bfloat16").type == pa.fixed_shape_tensor(pa.uint16(), [3, 2])  # its bits
    assert table.schema.field("grid").type == pa.fixed_shape_tensor(pa.int16(), [2])
    assert table.schema.field("fixed_str").type == pa.string()


def test_non_contiguous(tmp_path):
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    transposed = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).T
    assert not strided.is_contiguous() and not transposed.is_contiguous()
    p = DataProto.from_dict({"strided": strided, "transposed": transposed})
    p.save(str(tmp_path / "nc.arrow"))
    assert_proto_equal(DataProto.load(str(tmp_path / "nc.arrow")), p)


def test_an_unsupported_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="column 'c'.*complex64"):
        DataProto.from_dict({"c": torch.zeros(2, dtype=torch.complex64)}).save(str(tmp_path / "c.arrow"))
    assert os.listdir(tmp_path) == []  # a failed save leaves nothing behind
