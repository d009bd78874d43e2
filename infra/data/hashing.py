"""Content hashes of files on storage: what a record of a file (a data file an experiment read, a
checkpoint's file, a stored update input) keeps to tell later that the bytes are the same.

    digest = hash_bytes(b"...")                 # xxh3-64, hex
    size, digest = hash_file(fs, path)          # streamed, CHUNK bytes at a time
    h = new_hasher(); h.update(b"..."); h.hexdigest()

The hash is xxHash's XXH3 (64 bit, ``xxhash.xxh3_64``, named ``ALGORITHM`` in the records):
non-cryptographic, made to detect corruption (a flipped bit, a truncated or swapped file), about as
fast as memory can be read. It does not defend against someone who can write the bucket; storage
permissions do that.
"""

from __future__ import annotations

from typing import Any

import xxhash

__all__ = ["ALGORITHM", "CHUNK", "new_hasher", "hash_bytes", "hash_file"]

ALGORITHM = "xxh3_64"
CHUNK = 8 << 20


def new_hasher() -> Any:
    """An incremental hasher (``update(bytes)``, ``hexdigest()``) of :data:`ALGORITHM`."""
    return xxhash.xxh3_64()


def hash_bytes(data: bytes | memoryview) -> str:
    """The hex digest of ``data``."""
    return xxhash.xxh3_64_hexdigest(data)


def hash_file(fs: Any, path: str) -> tuple[int, str]:
    """(size, hex digest) of the file ``path`` on the fsspec filesystem ``fs``, read in chunks."""
    h, size = new_hasher(), 0
    with fs.open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
