"""Local files (``file://`` and plain paths; also a shared filesystem mounted at one path everywhere).

- create-if-absent: the data is written (and fsynced) under a temporary name, then ``link(2)``-ed
  to the target, which fails if the target exists; the directory is fsynced. Atomic on NFS too.
- replace-if-match, delete-if-match: under an exclusive ``flock`` on a guard file beside the
  target (``.<name>.tmp-guard``, removed after each step), the current content is read and
  compared, then the new content is renamed over it (``os.replace``) or the target unlinked.
  The target is never absent during a replace, so a concurrent create cannot slip in. A waiter
  whose guard was removed meanwhile (its inode no longer at the guard's path) takes a fresh one.
  Across hosts this is as dependable as the shared filesystem's ``flock`` (NFSv4: yes).
- version token: the SHA-256 of the content, as S3's ETag of a single-part object is the MD5 of
  its bytes. Inode numbers are reused right after a rename frees one, and modification times have
  the kernel clock's granularity (a jiffy), so neither tells two versions apart reliably; the
  content does. Two versions with the same bytes are the same version (the lock's and a lease's
  records carry a token and a time, so they do not repeat).
- atomic publish: write ``.<name>.tmp-<random>`` in the target directory, then ``os.replace``;
  ``fsync=True`` makes the content and the rename durable (manifests).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import IO

from ppoflow.infra.data.storage_backends.base import TEMP_MARKER, StorageBackend, content_token, temp_name

__all__ = ["LocalBackend", "atomic_local_path"]


class LocalBackend(StorageBackend):
    """Local files (see the module docstring)."""

    def path(self, url: str) -> str:
        return os.path.abspath(super().path(url))

    def create(self, url: str, data: bytes) -> str | None:
        path = self.path(url)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _written(path, data) as temp:
            try:
                os.link(temp, path)
            except FileExistsError:
                return None
        _fsync_dir(path)
        return content_token(data)

    def replace(self, url: str, data: bytes, token: str) -> str | None:
        path = self.path(url)
        try:
            with _guard(path):
                if content_token(_read(path)) != token:
                    return None
                with _written(path, data) as temp:
                    os.replace(temp, path)
        except FileNotFoundError:  # no target (or not even its directory)
            return None
        _fsync_dir(path)
        return content_token(data)

    def read_versioned(self, url: str) -> tuple[bytes, str]:
        data = _read(self.path(url))
        return data, content_token(data)

    def delete(self, url: str, token: str) -> bool:
        path = self.path(url)
        try:
            with _guard(path):
                if content_token(_read(path)) != token:
                    return False
                os.unlink(path)
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def open_atomic(self, url: str, *, fsync: bool = False) -> Iterator[IO[bytes]]:
        path = self.path(url)
        with atomic_local_path(path) as temp:
            with open(temp, "wb") as f:
                yield f
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        if fsync:
            _fsync_dir(path)


@contextlib.contextmanager
def atomic_local_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to local ``path``; on success it is renamed onto ``path``.

    For writers that want a native file (e.g. ``pyarrow.OSFile``) instead of a Python one. On an
    exception the temporary file is removed and nothing is published.
    """
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temp = temp_name(path)
    try:
        yield temp
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@contextlib.contextmanager
def _written(path: str, data: bytes) -> Iterator[str]:
    """A temporary file beside ``path`` holding ``data`` (fsynced); removed on the way out unless
    it was renamed away."""
    temp = temp_name(path)
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        yield temp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _fsync_dir(path: str) -> None:
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _guard(path: str) -> Iterator[None]:
    """Hold the exclusive guard of ``path`` (see the module docstring); FileNotFoundError when
    the directory of ``path`` does not exist."""
    head, name = os.path.split(path)
    guard = os.path.join(head, f".{name}{TEMP_MARKER}guard")
    while True:
        fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            mine = os.fstat(fd)
            try:
                now = os.stat(guard)
            except FileNotFoundError:
                continue  # its holder removed it: take a fresh one
            if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                continue
            try:
                yield
            finally:
                os.unlink(guard)
            return
        finally:
            os.close(fd)
