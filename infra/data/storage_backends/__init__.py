"""Storage backends: how ppoflow writes to each kind of storage, one backend per fsspec protocol.

    backend = storage.backend_for(url)             # ppoflow.infra.data.storage
    token = backend.create(url, data)              # None: something is already there
    token = backend.replace(url, new, token)       # None: it changed since ``token``
    data, token = backend.read_versioned(url)
    backend.delete(url, token)                     # False: it changed since ``token``
    with backend.open_atomic(url) as f: ...        # readers see all of it or nothing

base.py     the contract (``StorageBackend``), the registry (``register_backend``), the error of a
            protocol without a backend (``NoStorageBackend``)
local.py    local files and shared filesystems (``file``, ``local``): link(2), flock'd rename
s3.py       ``s3``, ``s3a`` through s3fs: conditional PUT/DELETE (``If-None-Match``, ``If-Match``)
memory.py   ``memory``: fsspec's in-process store under one lock (tests)

Reads (exists, listdir, read_bytes) stay plain fsspec (``ppoflow.infra.data.storage``).
"""

from __future__ import annotations

from ppoflow.infra.data.storage_backends.base import (
    TEMP_MARKER,
    NoStorageBackend,
    StorageBackend,
    backend_class,
    content_token,
    register_backend,
    registered_protocols,
    temp_name,
)
from ppoflow.infra.data.storage_backends.local import LocalBackend, atomic_local_path
from ppoflow.infra.data.storage_backends.memory import MemoryBackend
from ppoflow.infra.data.storage_backends.s3 import S3Backend

__all__ = [
    "StorageBackend",
    "NoStorageBackend",
    "register_backend",
    "registered_protocols",
    "backend_class",
    "content_token",
    "temp_name",
    "TEMP_MARKER",
    "LocalBackend",
    "MemoryBackend",
    "S3Backend",
    "atomic_local_path",
]

register_backend(("file", "local"), LocalBackend)
register_backend(("s3", "s3a"), S3Backend)
register_backend("memory", MemoryBackend)
