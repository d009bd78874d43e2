"""``memory://``: fsspec's in-process memory filesystem (tests, and single-process tools).

Every primitive runs under one process-wide lock, so each is truly atomic against the others in
this process (the memory filesystem is one store per process; nothing outside it can see it).
The version token is the SHA-256 of the content (as for local files). Atomic publish collects the
bytes in a buffer and stores them in one step when the block ends: nothing is visible before, and
nothing is left after an exception.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from typing import IO

from ppoflow.infra.data.storage_backends.base import StorageBackend, content_token

__all__ = ["MemoryBackend"]

_LOCK = threading.RLock()


class MemoryBackend(StorageBackend):
    """``memory://`` (see the module docstring)."""

    def _store(self, path: str, data: bytes) -> None:
        parent = self.fs._parent(path)
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(path, data)

    def create(self, url: str, data: bytes) -> str | None:
        path = self.path(url)
        with _LOCK:
            if self.fs.exists(path):
                return None
            self._store(path, data)
        return content_token(data)

    def replace(self, url: str, data: bytes, token: str) -> str | None:
        path = self.path(url)
        with _LOCK:
            try:
                current = self.fs.cat_file(path)
            except FileNotFoundError:
                return None
            if content_token(current) != token:
                return None
            self._store(path, data)
        return content_token(data)

    def read_versioned(self, url: str) -> tuple[bytes, str]:
        with _LOCK:
            data = self.fs.cat_file(self.path(url))
        return data, content_token(data)

    def delete(self, url: str, token: str) -> bool:
        path = self.path(url)
        with _LOCK:
            try:
                current = self.fs.cat_file(path)
            except FileNotFoundError:
                return False
            if content_token(current) != token:
                return False
            self.fs.rm_file(path)
        return True

    @contextlib.contextmanager
    def open_atomic(self, url: str, *, fsync: bool = False) -> Iterator[IO[bytes]]:
        path = self.path(url)
        buffer = io.BytesIO()
        yield buffer
        with _LOCK:
            self._store(path, buffer.getvalue())
