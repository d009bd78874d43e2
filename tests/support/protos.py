"""DataProtos of every dtype and kind, and their bit-exact equality: shared by the DataProto,
codec and storage tests."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]  # fmt: skip


def random_tensor(shape: tuple, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        if t.numel() > 2:  # special values must survive bit-exactly
            t.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0]).to(dtype)
        return t
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def full_proto(n: int = 4) -> DataProto:
    """Every dtype as a (n, 3, 2) tensor and a 1-D tensor, plus every kind of non-tensor column."""
    tensors = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).removeprefix("torch.")
        tensors[name] = random_tensor((n, 3, 2), dt, seed=i)
        tensors[name + "_1d"] = random_tensor((n,), dt, seed=100 + i)
    tensors["empty_trailing"] = torch.zeros(n, 0)
    non_tensors = {
        "raw_prompt": objects([f"prompt {i} ünïcødé" for i in range(n)]),
        "ragged": objects([list(range(i)) for i in range(n)]),
        "extra_info": objects([{"index": i, "split": "train", "tags": ["a"] * i} for i in range(n)]),
        "sparse_dicts": objects([{f"k{i}": i} for i in range(n)]),  # differing keys -> map
        "mixed": objects([1, "a", 2.5, None][:n]),  # not one Arrow type -> JSON
        "nested": objects([{"a": [{"b": None}], "f": float("nan")}] * n),
        "numbers": np.arange(n, dtype=np.float32) / 3,
        "u8": np.arange(n, dtype=np.uint8),
        "fixed_str": np.array([f"s{i}" for i in range(n)]),
        "grid": np.arange(n * 2, dtype=np.int16).reshape(n, 2),
        "obj_grid": np.arange(n * 2).reshape(n, 2).astype(object),
    }
    meta = {"iteration": 12, "temperature": 0.7, "nested": {"list": [1, 2, {"x": None}]}, "name": "ppo"}
    return DataProto.from_dict(tensors, non_tensors, meta)


def saved_table(proto: DataProto, path: str):
    """``proto`` saved at ``path`` and read back with plain pyarrow (no ppoflow code)."""
    import pyarrow.ipc as ipc

    proto.save(path)
    return ipc.open_file(path).read_all()


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
