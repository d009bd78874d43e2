"""Object columns (``arrow_objects``): native Arrow types where they give back exactly the same
Python values (string, list, struct), an Arrow map for dicts with differing keys, one JSON string
per value otherwise; a value none of them keeps is refused by name."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppoflow.infra.data.arrow_objects import encode_objects, object_values
from ppoflow.infra.data.dataproto import DataProto
from tests.support.protos import full_proto, objects, same_values, saved_table


def test_plain_pyarrow_sees_meaningful_columns(tmp_path):
    p = full_proto()
    table = saved_table(p, str(tmp_path / "r.arrow"))
    assert table.schema.field("raw_prompt").type == pa.string()
    assert table.schema.field("ragged").type == pa.list_(pa.int64())
    assert pa.types.is_struct(table.schema.field("extra_info").type)
    assert pa.types.is_map(table.schema.field("sparse_dicts").type)
    assert table.column("raw_prompt").to_pylist() == list(p.non_tensor_batch["raw_prompt"])
    encodings = {k: encode_objects(k, p.non_tensor_batch[k])[1] for k in ("ragged", "sparse_dicts", "mixed")}
    assert encodings == {"ragged": "arrow", "sparse_dicts": "map", "mixed": "json"}


_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_values, min_size=1, max_size=5))
def test_every_json_like_value_comes_back_exactly(values):
    arr, encoding = encode_objects("v", objects(values))
    assert same_values(object_values(arr, encoding), values), encoding


def test_values_that_cannot_be_stored_exactly_are_refused(tmp_path):
    with pytest.raises(TypeError, match="column 'o'.*cannot be stored exactly"):
        DataProto.from_dict(non_tensors={"o": [object(), 1]}).save(str(tmp_path / "o.arrow"))
    assert os.listdir(tmp_path) == []  # a failed save leaves nothing behind
