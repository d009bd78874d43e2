"""Hashing checkpoint files while DCP's file system writes them: the record is the hash of the
bytes on storage, and a stream that moves backwards is not trusted (its file is hashed again)."""

from __future__ import annotations

import fsspec
from torch.distributed.checkpoint.filesystem import FileSystem

from ppoflow.infra.checkpoint.integrity import HashingFileSystem
from ppoflow.infra.data.hashing import hash_file


def test_written_files_are_recorded_with_the_hash_of_their_bytes(tmp_path):
    opened = []
    fs = HashingFileSystem(FileSystem(), on_open=opened.append)
    with fs.create_stream(tmp_path / "a.tmp", "wb") as f:
        f.write(b"x" * 1000)
        assert f.tell() == 1000
        f.write(memoryview(b"yz"))
    fs.rename(tmp_path / "a.tmp", tmp_path / "a")
    local = fsspec.filesystem("file")
    assert fs.records == {str(tmp_path / "a"): hash_file(local, str(tmp_path / "a"))}
    with fs.create_stream(tmp_path / "b", "wb") as f:  # rewinding: the stream cannot be followed
        f.write(b"abc")
        f.seek(0)
        f.write(b"A")
    assert fs.records[str(tmp_path / "b")] is None and (tmp_path / "b").read_bytes() == b"Abc"
    with fs.create_stream(tmp_path / "a", "rb") as f:  # reads are not recorded, nor announced
        assert f.read(3) == b"xxx"
    assert opened == [tmp_path / "a.tmp", tmp_path / "b"] and len(fs.records) == 2
