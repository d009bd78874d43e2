"""Arrow codec and storage: round trips through file://, plain paths, memory:// and s3:// (moto)."""

from __future__ import annotations

import json
import os
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppoflow.infra.data import storage
from ppoflow.infra.data.arrow_codec import META_KEY
from ppoflow.infra.data.dataproto import DataProto, DataProtoFormatError
from tests.support.protos import assert_proto_equal

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


@pytest.fixture(params=["plain", "relative", "file", "memory", "s3"])
def base_url(request, tmp_path, monkeypatch):
    """A fresh directory URL of each kind."""
    kind = request.param
    if kind == "plain":
        return str(tmp_path)
    if kind == "relative":
        monkeypatch.chdir(tmp_path)
        return "rel/dir"
    if kind == "file":
        return "file://" + str(tmp_path)
    if kind == "memory":
        return f"memory://ppoflow-tests/{uuid.uuid4().hex}"
    server = request.getfixturevalue("s3_server")
    return f"{server['url']}/{uuid.uuid4().hex}"


def test_round_trip_every_dtype_and_kind(base_url):
    p = full_proto()
    url = storage.join(base_url, "iterations", "000012", "rollout.arrow")
    p.save(url)
    assert storage.exists(url)
    q = DataProto.load(url)
    assert_proto_equal(p, q)
    assert q.batch["bfloat16"].view(torch.int16).equal(p.batch["bfloat16"].view(torch.int16))
    assert q.non_tensor_batch["extra_info"][2] == {"index": 2, "split": "train", "tags": ["a", "a"]}
    assert q.non_tensor_batch["sparse_dicts"][1] == {"k1": 1}
    assert q.batch["int64"].numpy().flags.writeable
    q.batch["float32"] += 1  # loaded tensors are ordinary writable tensors
    sub = DataProto.load(url, columns=["bfloat16", "extra_info"])
    assert list(sub.batch) == ["bfloat16"] and list(sub.non_tensor_batch) == ["extra_info"]
    assert_proto_equal(sub, p.select(["bfloat16"], ["extra_info"]))
    only_meta = DataProto.load(url, columns=[])
    assert len(only_meta) == 0 and only_meta.meta_info == p.meta_info
    assert storage.listdir(storage.join(base_url, "iterations", "000012")) == ["rollout.arrow"]
    if base_url == "rel/dir":
        assert os.path.exists(os.path.join(os.getcwd(), "rel/dir/iterations/000012/rollout.arrow"))


def test_plain_pyarrow_sees_meaningful_columns(tmp_path):
    p = full_proto()
    path = str(tmp_path / "r.arrow")
    p.save(path)
    with open(path, "rb") as f:
        assert f.read(6) == b"ARROW1"  # the IPC *file* format
    table = ipc.open_file(path).read_all()
    assert table.column_names == list(p.batch) + list(p.non_tensor_batch)
    assert table.schema.field("float32").type == pa.fixed_shape_tensor(pa.float32(), [3, 2])
    assert table.schema.field("int64_1d").type == pa.int64()
    assert table.schema.field("raw_prompt").type == pa.string()
    assert table.schema.field("ragged").type == pa.list_(pa.int64())
    assert pa.types.is_struct(table.schema.field("extra_info").type)
    assert pa.types.is_map(table.schema.field("sparse_dicts").type)
    assert json.loads(table.schema.metadata[b"ppoflow.meta_info"]) == p.meta_info
    assert table.column("raw_prompt").to_pylist() == list(p.non_tensor_batch["raw_prompt"])


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=5),
    trailing=st.lists(st.integers(min_value=0, max_value=3), max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(min_value=0, max_value=10_000),
    target=st.sampled_from(["local", "memory"]),
)
def test_codec_round_trip_random_shapes(tmp_path_factory, n, trailing, dtype, seed, target):
    t = random_tensor((n, *trailing), dtype, seed)
    arr = np.random.default_rng(seed).normal(size=(n, *trailing[:1]))
    p = DataProto.from_dict({"x": t}, {"a": arr, "s": [str(i) * i for i in range(n)]}, {"seed": seed})
    base = str(tmp_path_factory.mktemp("h")) if target == "local" else f"memory://h/{uuid.uuid4().hex}"
    p.save(storage.join(base, "x.arrow"))
    assert_proto_equal(DataProto.load(storage.join(base, "x.arrow")), p)


def test_non_contiguous_and_compressed(tmp_path):
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    transposed = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).T
    assert not strided.is_contiguous() and not transposed.is_contiguous()
    p = DataProto.from_dict({"strided": strided, "transposed": transposed})
    p.save(str(tmp_path / "nc.arrow"))
    assert_proto_equal(DataProto.load(str(tmp_path / "nc.arrow")), p)
    p.save(str(tmp_path / "z.arrow"), compression="zstd")
    assert_proto_equal(DataProto.load(str(tmp_path / "z.arrow")), p)


# ---------------------------------------------------------------- errors


def test_bad_files_raise_format_error(tmp_path):
    random_bytes = tmp_path / "random.arrow"
    random_bytes.write_bytes(os.urandom(4096))
    with pytest.raises(
        DataProtoFormatError,
        match=r"random\.arrow is not a ppoflow DataProto file: it is not an Arrow IPC file",
    ):
        DataProto.load(str(random_bytes))
    empty = tmp_path / "empty.arrow"
    empty.write_bytes(b"")
    with pytest.raises(DataProtoFormatError, match="not an Arrow IPC file"):
        DataProto.load(str(empty))

    plain = str(tmp_path / "plain.arrow")
    table = pa.table({"a": [1, 2], "b": ["x", "y"]})
    with ipc.new_file(plain, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(
        DataProtoFormatError,
        match=r"plain\.arrow is an Arrow IPC file but not a ppoflow DataProto.*columns: a, b.*DataProto\.from_dict",
    ):
        DataProto.load(plain)

    good = str(tmp_path / "good.arrow")
    full_proto().save(good)
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.arrow"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        DataProtoFormatError,
        match=r"truncated\.arrow cannot be read as a DataProto: .*truncated or corrupt.*DataProto\.save",
    ):
        DataProto.load(str(truncated))
    with pytest.raises(
        DataProtoFormatError, match=r"has no column\(s\) 'nope' \(available: bool, .*Pass columns="
    ):
        DataProto.load(good, columns=["bool", "nope"])
    assert isinstance(DataProtoFormatError("x"), ValueError)
    with pytest.raises(FileNotFoundError):
        DataProto.load(str(tmp_path / "missing.arrow"))


def test_bad_files_over_s3(s3_server):
    url = f"{s3_server['url']}/bad/{uuid.uuid4().hex}.arrow"
    storage.write_bytes_atomic(url, os.urandom(1000))
    with pytest.raises(DataProtoFormatError, match="not an Arrow IPC file"):
        DataProto.load(url)
    with pytest.raises(DataProtoFormatError, match="not an Arrow IPC file"):
        DataProto.load(url, columns=["x"])
    good = f"{s3_server['url']}/bad/good.arrow"
    full_proto().save(good)
    with pytest.raises(DataProtoFormatError, match=r"no column\(s\) 'x'"):
        DataProto.load(good, columns=["x"])


def test_newer_format_version_and_unsavable_values(tmp_path):
    batch = pa.record_batch({"a": [1]})
    header = {"format": "ppoflow.DataProto", "version": 99, "num_rows": 1, "columns": {}}
    batch = batch.replace_schema_metadata({META_KEY: json.dumps(header)})
    path = str(tmp_path / "future.arrow")
    with ipc.new_file(path, batch.schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(DataProtoFormatError, match="version 99.*Upgrade ppoflow"):
        DataProto.load(path)
    with pytest.raises(TypeError, match="column 'c'.*complex64"):
        DataProto.from_dict({"c": torch.zeros(2, dtype=torch.complex64)}).save(str(tmp_path / "c.arrow"))
    with pytest.raises(TypeError, match="column 'o'.*cannot be stored exactly"):
        DataProto.from_dict(non_tensors={"o": [object(), 1]}).save(str(tmp_path / "o.arrow"))
    with pytest.raises(TypeError, match="meta_info must be JSON"):
        DataProto(meta_info={"t": torch.zeros(1)}).save(str(tmp_path / "m.arrow"))
    assert os.listdir(tmp_path) == ["future.arrow"]  # failed saves leave nothing behind


# ---------------------------------------------------------------- storage


def raw_listing(url: str) -> list[str]:
    """Every name under url, temporary files included."""
    fs, path = storage.url_to_fs(url)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def test_open_atomic_discards_on_exception(base_url):
    url = storage.join(base_url, "dir", "file.bin")
    storage.write_bytes_atomic(storage.join(base_url, "dir", "other.bin"), b"x")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.open_atomic(url) as f:
            f.write(b"partial" * 1000)
            raise RuntimeError("boom")
    assert not storage.exists(url)
    assert raw_listing(storage.join(base_url, "dir")) == ["other.bin"]
    # an overwrite that fails keeps the old content
    storage.write_bytes_atomic(url, b"old")
    with pytest.raises(TypeError):
        with storage.open_atomic(url) as f:
            f.write(b"new")
            raise TypeError
    assert storage.read_bytes(url) == b"old"
    assert raw_listing(storage.join(base_url, "dir")) == ["file.bin", "other.bin"]


def test_large_s3_write_is_published_whole(s3_server):
    url = f"{s3_server['url']}/big/{uuid.uuid4().hex}.bin"
    payload = os.urandom(12 * 2**20)  # above s3fs's 5 MiB block: a multipart upload
    with pytest.raises(RuntimeError):
        with storage.open_atomic(url) as f:
            f.write(payload)
            raise RuntimeError("abort the multipart upload")
    assert not storage.exists(url)
    storage.write_bytes_atomic(url, payload)
    assert storage.read_bytes(url) == payload


def test_storage_helpers(base_url):
    d = storage.join(base_url, "exp")
    assert storage.join("s3://b/", "/x/", "y") == "s3://b/x/y"
    storage.write_json_atomic(storage.join(d, "manifest.json"), {"iteration": 3, "urls": ["a"]})
    assert storage.read_json(storage.join(d, "manifest.json")) == {"iteration": 3, "urls": ["a"]}
    storage.write_bytes_atomic(storage.join(d, "sub", "a.bin"), b"abc")
    assert storage.listdir(d) == ["manifest.json", "sub"]
    assert storage.read_bytes(storage.join(d, "sub", "a.bin")) == b"abc"
    storage.rm(storage.join(d, "sub"), recursive=True)
    assert not storage.exists(storage.join(d, "sub", "a.bin"))
    storage.rm(storage.join(d, "manifest.json"))
    assert not storage.exists(storage.join(d, "manifest.json"))
    storage.write_bytes_atomic(storage.join(d, "bad.json"), b"{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        storage.read_json(storage.join(d, "bad.json"))


def test_listdir_hides_temporary_files(tmp_path):
    (tmp_path / "a.arrow").write_bytes(b"1")
    (tmp_path / f".a.arrow{storage.TEMP_MARKER}123").write_bytes(b"partial")
    assert storage.listdir(str(tmp_path)) == ["a.arrow"]
    assert storage.listdir("file://" + str(tmp_path)) == ["a.arrow"]


def test_default_storage_options_give_the_s3_endpoint(s3_server, monkeypatch):
    import s3fs

    url = f"{s3_server['url']}/opts/{uuid.uuid4().hex}.arrow"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        storage.set_default_storage_options("s3", {"endpoint_url": s3_server["endpoint_url"]})
        full_proto(2).save(url)
        assert_proto_equal(DataProto.load(url), full_proto(2))
        assert storage.url_to_fs(url, {"anon": False})[0].endpoint_url == s3_server["endpoint_url"]
    finally:
        storage.set_default_storage_options("s3", None)
        s3fs.S3FileSystem.clear_instance_cache()
    fs = fsspec.filesystem("s3", endpoint_url=s3_server["endpoint_url"])
    assert fs.exists(url)
