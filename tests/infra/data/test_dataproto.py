"""DataProto operations: construction, selection, union, chunk/concat, repeat, padding, indexing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppoflow.infra.data.dataproto import DataProto
from tests.support.protos import assert_proto_equal


def make(n: int = 6, meta: dict | None = None) -> DataProto:
    """A small DataProto whose rows are identifiable (row i holds i)."""
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra": [{"i": i} for i in range(n)]},
        meta_info=meta if meta is not None else {"step": 1},
    )


def rows(p: DataProto) -> list[int]:
    return p.batch["score"].long().tolist()


# ---------------------------------------------------------------- construction


def test_from_dict_converts_lists_to_object_arrays():
    p = DataProto.from_dict(non_tensors={"l": [[1, 2], [3, 4]], "s": ["a", "b"]})
    assert p.non_tensor_batch["l"].dtype == object and p.non_tensor_batch["l"].shape == (2,)
    assert p.non_tensor_batch["l"][1] == [3, 4]
    assert len(p) == 2 and len(DataProto()) == 0


def test_from_dict_rejects_mismatched_rows_naming_the_key():
    with pytest.raises(ValueError, match=r"'mask' has 3 rows but 'ids' has 4"):
        DataProto.from_dict({"ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"'uid' has 2 rows"):
        DataProto.from_dict({"ids": torch.zeros(4)}, {"uid": ["a", "b"]})
    with pytest.raises(ValueError, match="both in batch and non_tensor_batch"):
        DataProto(batch={"x": torch.zeros(2)}, non_tensor_batch={"x": np.zeros(2)})
    with pytest.raises(ValueError, match="0-dimensional"):
        DataProto.from_dict({"x": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="must be a Tensor"):
        DataProto(batch={"x": np.zeros(2)})
    with pytest.raises(TypeError, match="pass it in tensors="):
        DataProto.from_dict(non_tensors={"x": torch.zeros(2)})


# ---------------------------------------------------------------- select / pop / union


def test_select_and_pop():
    p = make(meta={"a": 1, "b": 2})
    s = p.select(batch_keys=["ids"], non_tensor_batch_keys=[], meta_info_keys=["a"])
    assert list(s.batch) == ["ids"] and not s.non_tensor_batch and s.meta_info == {"a": 1}
    assert s.batch["ids"].data_ptr() == p.batch["ids"].data_ptr()  # storage shared
    assert_proto_equal(p.select(), p)
    with pytest.raises(KeyError, match="nope"):
        p.select(batch_keys=["nope"])
    popped = p.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["b"])
    assert (
        list(popped.batch) == ["score"]
        and list(popped.non_tensor_batch) == ["uid"]
        and popped.meta_info == {"b": 2}
    )
    assert list(p.batch) == ["ids"] and list(p.non_tensor_batch) == ["extra"] and p.meta_info == {"a": 1}
    assert len(p.pop()) == 0 and len(p) == 6


def test_union_merges_and_refuses_conflicts():
    p = make()
    q = DataProto.from_dict(
        {"ids": p.batch["ids"].clone(), "v": torch.ones(6)},
        {"uid": p.non_tensor_batch["uid"].copy()},
        {"x": 1, "step": 1},
    )
    u = p.union(q)
    assert set(u.batch) == {"ids", "score", "v"} and set(u.non_tensor_batch) == {"uid", "extra"}
    assert u.meta_info == {"step": 1, "x": 1}
    assert "v" not in p.batch  # self untouched
    bad_t = DataProto.from_dict({"ids": p.batch["ids"] + 1})
    with pytest.raises(ValueError, match="batch key 'ids'"):
        p.union(bad_t)
    bad_a = DataProto.from_dict(non_tensors={"extra": [{"i": 0}] * 6})
    with pytest.raises(ValueError, match="non_tensor_batch key 'extra'"):
        p.union(bad_a)
    with pytest.raises(ValueError, match="meta_info key 'step'"):
        p.union(DataProto(meta_info={"step": 2}))
    with pytest.raises(ValueError, match="lengths 6 and 2"):
        p.union(make(2))
    assert p.union(DataProto(meta_info={"y": 2})).meta_info == {"step": 1, "y": 2}


# ---------------------------------------------------------------- chunk / concat / repeat / pad


def test_chunk_concat_and_errors():
    p = make(6)
    parts = p.chunk(3)
    assert [rows(c) for c in parts] == [[0, 1], [2, 3], [4, 5]]
    assert_proto_equal(DataProto.concat(parts), p)
    with pytest.raises(ValueError, match=r"pad_to_divisor\(4\)"):
        p.chunk(4)
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])
    with pytest.raises(ValueError, match="different keys"):
        DataProto.concat([p, p.select(batch_keys=["ids"])])
    other = make(2)
    other.batch["score"] = other.batch["score"].double()
    with pytest.raises(ValueError, match="'score' is torch.float32 in part 0 and torch.float64 in part 1"):
        DataProto.concat([p, other])
    assert DataProto.concat([make(2, {"a": 1}), make(2, {"a": 2})]).meta_info == {"a": 1}


def test_repeat_interleave_and_tile():
    p = make(3)
    assert rows(p.repeat(2)) == [0, 0, 1, 1, 2, 2]
    assert rows(p.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    r = p.repeat(2)
    assert r.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert r.batch["ids"].shape == (6, 3)


def test_pad_to_divisor_cycles_rows_from_start():
    p = make(2)
    padded, pad = p.pad_to_divisor(7)
    assert pad == 5
    assert rows(padded) == [0, 1, 0, 1, 0, 1, 0]
    assert_proto_equal(padded.unpad(pad), p)
    same, zero = p.pad_to_divisor(2)
    assert zero == 0 and same is p
    with pytest.raises(ValueError, match="unpad"):
        p.unpad(3)


# ---------------------------------------------------------------- indexing


def test_indexing():
    p = make(6)
    assert rows(p[1:3]) == [1, 2]
    one = p[-1]
    assert isinstance(one, DataProto) and len(one) == 1 and rows(one) == [5]
    assert one.non_tensor_batch["extra"][0] == {"i": 5}
    assert rows(p[[4, 0]]) == [4, 0]
    assert rows(p[np.array([2, 2])]) == [2, 2]
    assert rows(p[torch.tensor([5, 1])]) == [5, 1]
    mask = np.array([True, False, True, False, False, True])
    assert rows(p[mask]) == [0, 2, 5] and rows(p[torch.from_numpy(mask)]) == [0, 2, 5]
    assert len(p[[]]) == 0
    with pytest.raises(IndexError):
        p[6]
    with pytest.raises(IndexError):
        p[[0, 9]]
    with pytest.raises(IndexError, match="mask"):
        p[np.array([True, False])]
    with pytest.raises(TypeError):
        p["ids"]


def test_to_device():
    p = make(2)
    q = p.to("cpu")
    assert q.batch["ids"].device.type == "cpu"
    assert_proto_equal(p, q)


# ---------------------------------------------------------------- properties

sizes = st.integers(min_value=0, max_value=12)
small = st.integers(min_value=1, max_value=5)


@settings(max_examples=30, deadline=None)
@given(n=sizes, k=small)
def test_chunk_concat_identity(n, k):
    p = make(n * k)
    parts = p.chunk(k)
    assert all(len(c) == n for c in parts)
    assert_proto_equal(DataProto.concat(parts), p)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(min_value=1, max_value=12), k=st.integers(min_value=1, max_value=9))
def test_pad_unpad_identity(n, k):
    p = make(n)
    padded, pad = p.pad_to_divisor(k)
    assert len(padded) % k == 0 and 0 <= pad < k and len(padded) == n + pad
    assert rows(padded)[n:] == [i % n for i in range(pad)]
    assert_proto_equal(padded.unpad(pad), p)
    assert_proto_equal(DataProto.concat(padded.chunk(k)).unpad(pad), p)


@settings(max_examples=30, deadline=None)
@given(n=sizes, r=small)
def test_repeat_identities(n, r):
    p = make(n)
    inter, tiled = p.repeat(r), p.repeat(r, interleave=False)
    assert len(inter) == len(tiled) == n * r
    for i in range(r):
        assert_proto_equal(inter[i::r], p)
        assert_proto_equal(tiled[i * n : (i + 1) * n], p)
