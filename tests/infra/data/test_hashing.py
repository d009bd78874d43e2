"""Content hashes: XXH3-64 as published, the same for a file streamed in chunks as for its bytes."""

from __future__ import annotations

import os

import fsspec

from ppoflow.infra.data.hashing import CHUNK, hash_bytes, hash_file, new_hasher


def test_digests_are_xxh3_64_and_a_streamed_file_hashes_as_its_bytes(tmp_path):
    assert hash_bytes(b"") == "2d06800538d394c2"  # XXH3_64bits of the empty input, seed 0
    data = os.urandom(2 * CHUNK + 123)  # three reads, the last one short
    (tmp_path / "f").write_bytes(data)
    fs = fsspec.filesystem("file")
    assert hash_file(fs, str(tmp_path / "f")) == (len(data), hash_bytes(data))
    h = new_hasher()
    for start in range(0, len(data), 1000003):
        h.update(data[start : start + 1000003])
    assert h.hexdigest() == hash_bytes(memoryview(data))
    assert hash_bytes(data[:-1] + bytes([data[-1] ^ 1])) != hash_bytes(data)  # one flipped bit
