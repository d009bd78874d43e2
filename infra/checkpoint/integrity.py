"""Content hashes of checkpoint files, computed while DCP writes them (checked before a load by
``marker``, with :func:`ppoflow.infra.data.hashing.hash_file`).

    writer.fs = HashingFileSystem(writer.fs)             # DCP's writer: every file it writes is hashed
    writer.fs.records                                    # {path: (size, digest)} of the files it closed

The hash is :mod:`ppoflow.infra.data.hashing`'s (xxh3-64), as every file record of an experiment.

Hashing while writing: DCP's file writers open every output file through ``writer.fs.create_stream``
(``torch.distributed.checkpoint.filesystem.FileSystem`` for local paths, the fsspec one otherwise;
the same in torch 2.11 through 2.13). :class:`HashingFileSystem` wraps that object and hashes each
byte on its way to storage, so the record costs no second read. A stream that is read or seeked
backwards while writing is marked untrusted and its file is hashed again from storage instead
(``hash_file``), so a change in DCP's writer can cost time, never correctness.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

from ppoflow.infra.data.hashing import new_hasher

__all__ = ["HashingStream", "HashingFileSystem"]


class HashingStream(io.RawIOBase):
    """A write-only view of ``raw`` that hashes every byte written through it.

    Position queries pass through (DCP records each tensor's offset with ``tell()``); anything that
    moves the position other than appending makes the stream ``trusted = False``.
    """

    def __init__(self, raw: Any, gate: threading.Event | None = None):
        super().__init__()
        self.raw = raw
        self.gate = gate
        self.hasher = new_hasher()
        self.size = 0
        self.trusted = True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.gate is not None:
            self.gate.wait()  # the owner paused the writes (see CheckpointWriter.paused)
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        n = len(view) if written is None else int(written)
        if n != len(view):  # a partial write: the caller retries the rest, which we cannot follow
            self.trusted = False
        self.hasher.update(view[:n])
        self.size += n
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = self.raw.seek(offset, whence)
        if pos != self.size:
            self.trusted = False
        return pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:  # the owner (create_stream's context) closes ``raw``
        super().close()


class HashingFileSystem:
    """Wraps a DCP ``FileSystem``: files opened for writing are hashed as they are written.

    ``records`` maps the path (as a string, after any ``rename``) to ``(size, digest)``, or to
    ``None`` when the stream could not be followed (hash the file from storage instead).
    ``on_open(path)``, if given, is called before a file is opened for writing (fault drills);
    ``gate``, if given, is waited on before every write (cleared: the writes pause). Everything else
    is delegated to the wrapped object.
    """

    def __init__(self, inner: Any, on_open: Any = None, gate: threading.Event | None = None):
        self._inner = inner
        self._on_open = on_open
        self._gate = gate
        self.records: dict[str, tuple[int, str] | None] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if self._on_open is not None and ("w" in mode or "a" in mode):
            self._on_open(path)
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode and "a" not in mode:
                yield stream
                return
            wrapped = HashingStream(stream, self._gate)
            yield wrapped
            record = (
                (wrapped.size, wrapped.hasher.hexdigest()) if wrapped.trusted and "a" not in mode else None
            )
            with self._lock:
                self.records[str(path)] = record

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            if str(path) in self.records:
                self.records[str(new_path)] = self.records.pop(str(path))
