"""The DataProto file (``arrow_codec``): round trips through plain paths, relative paths,
file://, memory:// and s3:// (moto), an Arrow IPC file plain pyarrow reads, and one clear error
for every file that is not a DataProto. The columns' encodings: test_arrow_columns.py and
test_arrow_objects.py."""

from __future__ import annotations

import json
import os
import uuid

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
from tests.support.protos import DTYPES, assert_proto_equal, full_proto, random_tensor, saved_table


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


def test_plain_pyarrow_reads_the_file(tmp_path):
    p = full_proto()
    path = str(tmp_path / "r.arrow")
    table = saved_table(p, path)
    with open(path, "rb") as f:
        assert f.read(6) == b"ARROW1"  # the IPC *file* format
    assert table.column_names == list(p.batch) + list(p.non_tensor_batch)
    assert json.loads(table.schema.metadata[b"ppoflow.meta_info"]) == p.meta_info


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


def test_compressed(tmp_path):
    strided = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    transposed = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).T
    p = DataProto.from_dict({"strided": strided, "transposed": transposed})
    p.save(str(tmp_path / "z.arrow"), compression="zstd")
    assert_proto_equal(DataProto.load(str(tmp_path / "z.arrow")), p)
    every = full_proto()
    every.save(str(tmp_path / "every.arrow"), compression="zstd")
    assert_proto_equal(DataProto.load(str(tmp_path / "every.arrow")), every)


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


def test_newer_format_version_and_meta_info_that_is_not_json(tmp_path):
    batch = pa.record_batch({"a": [1]})
    header = {"format": "ppoflow.DataProto", "version": 99, "num_rows": 1, "columns": {}}
    batch = batch.replace_schema_metadata({META_KEY: json.dumps(header)})
    path = str(tmp_path / "future.arrow")
    with ipc.new_file(path, batch.schema) as writer:
        writer.write_batch(batch)
    with pytest.raises(DataProtoFormatError, match="version 99.*Upgrade ppoflow"):
        DataProto.load(path)
    with pytest.raises(TypeError, match="meta_info must be JSON"):
        DataProto(meta_info={"t": torch.zeros(1)}).save(str(tmp_path / "m.arrow"))
    assert os.listdir(tmp_path) == ["future.arrow"]  # a failed save leaves nothing behind
