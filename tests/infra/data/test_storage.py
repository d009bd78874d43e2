"""Object storage (``storage``) on plain paths, relative paths, file://, memory:// and s3:// (moto):
writes published whole or not at all, the helpers, temporary names hidden, default options."""

from __future__ import annotations

import os
import uuid

import fsspec
import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from tests.support.protos import assert_proto_equal, full_proto


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
