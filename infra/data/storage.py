"""Object storage for ppoflow, on top of fsspec.

Every URL fsspec understands works: plain paths (relative ones resolve against the current
directory), ``file://`` URLs, ``s3://`` through s3fs and ``memory://`` in tests.

S3 endpoint and credentials come from the standard AWS environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``),
which botocore (and so s3fs) honours itself, or from storage options: per call
(``storage_options=``) or per protocol (:func:`set_default_storage_options`); per-call options win.
A run's options (``storage.storage_options``) belong to its :class:`RunStorage`: they are its
root protocol's defaults while the run is open, and the defaults before it once it closes.

Writes go through the storage backend of the URL's fsspec protocol (:func:`backend_for`,
``ppoflow.infra.data.storage_backends``): local files (``file``), ``s3``/``s3a`` and ``memory``.
Each provides create-if-absent, replace-if-match (with delete-if-match) and atomic publication
(readers never see a partial file); its module says how in full:

    protocol   create-if-absent        replace/delete-if-match        atomic publish          token
    file       link(2) of a temp file  flock'd guard, os.replace      temp name + os.replace  SHA-256
    s3, s3a    PUT If-None-Match: *    PUT/DELETE If-Match: ETag      the key's own PUT/MPU   ETag
    memory     under one process lock  under one process lock         one store step          SHA-256

A protocol without a backend is refused at the first write (or lock) with ``NoStorageBackend``,
naming the protocol, the primitives it lacks and how to register them; reads (:func:`exists`,
:func:`read_bytes`, :func:`listdir`) are plain fsspec for every protocol.

Temporary names match :data:`TEMP_MARKER` and are hidden from :func:`listdir`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ppoflow.infra.data.storage_backends import (
    TEMP_MARKER,
    NoStorageBackend,
    StorageBackend,
    atomic_local_path,
    backend_class,
    register_backend,
)

__all__ = [
    "RunStorage",
    "set_default_storage_options",
    "get_default_storage_options",
    "url_to_fs",
    "is_local",
    "is_s3",
    "join",
    "exists",
    "read_bytes",
    "write_bytes_atomic",
    "read_json",
    "write_json_atomic",
    "listdir",
    "rm",
    "open_atomic",
    "atomic_local_path",
    "backend_for",
    "register_backend",
    "StorageBackend",
    "NoStorageBackend",
    "TEMP_MARKER",
]

_DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {}


def set_default_storage_options(protocol: str, options: dict | None) -> None:
    """Set the storage options used for every URL of ``protocol`` (e.g. ``"s3"``).

    ``options`` are fsspec filesystem keyword arguments, e.g.
    ``{"endpoint_url": "http://127.0.0.1:9000", "key": ..., "secret": ...}`` for s3
    (s3fs also accepts ``client_kwargs``). ``None`` or ``{}`` removes the defaults.
    """
    protocol = protocol.rstrip(":/").lower()
    if options:
        _DEFAULT_OPTIONS[protocol] = dict(options)
    else:
        _DEFAULT_OPTIONS.pop(protocol, None)


def get_default_storage_options(protocol: str) -> dict:
    """Return a copy of the default storage options of ``protocol`` (empty when none)."""
    return dict(_DEFAULT_OPTIONS.get(protocol.rstrip(":/").lower(), {}))


class RunStorage:
    """A run's storage: its root URL and the fsspec options of the root's protocol
    (``storage.storage_options``). :meth:`open` makes the options that protocol's defaults in this
    process, where the run's flow and tasks read and write through them; :meth:`close` puts back
    the defaults that were there before (another run's, or none), so nothing outlives the run."""

    def __init__(self, root: str, options: dict[str, Any] | None = None):
        self.root, self.options = root, dict(options or {})
        self.protocol = protocol_of(root)
        self._before: dict[str, Any] | None = None
        self._open = False

    def open(self) -> RunStorage:
        if self._open:
            raise RuntimeError(f"the storage of {self.root} is open already")
        if self.options:
            self._before = _DEFAULT_OPTIONS.get(self.protocol)
            set_default_storage_options(self.protocol, self.options)
        self._open = True
        return self

    def close(self) -> None:
        """Put back the protocol's defaults from before :meth:`open` (idempotent)."""
        if self._open and self.options:
            set_default_storage_options(self.protocol, self._before)
        self._open = False

    def __enter__(self) -> RunStorage:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url_to_fs(self, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """:func:`url_to_fs` with the run's options (whether it is open or not)."""
        return url_to_fs(url, self.options if protocol_of(url) == self.protocol else None)


def protocol_of(url: str) -> str:
    """The fsspec protocol of ``url`` (``s3``, ``memory``, ...; ``file`` for a plain path)."""
    if "://" in url:
        return url.split("://", 1)[0].lower()
    return "file"


def url_to_fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path inside it)`` for ``url``.

    Options are the protocol's defaults updated with ``storage_options``. Local paths come back
    absolute.
    """
    url = os.fspath(url)
    options = {**get_default_storage_options(protocol_of(url)), **(storage_options or {})}
    return fsspec.core.url_to_fs(url, **options)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """True when ``fs`` is the local filesystem (paths are OS paths)."""
    return isinstance(fs, LocalFileSystem)


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    """True when ``fs`` is an S3 filesystem (s3fs)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return any(p in ("s3", "s3a") for p in protocols)


def join(base_url: str, *parts: str) -> str:
    """Join URL or path parts with ``/`` (``join("s3://b/exp", "iterations", "000001")``)."""
    out = os.fspath(base_url)
    for part in parts:
        part = os.fspath(part).strip("/")
        if not part:
            continue
        out = part if not out else out.rstrip("/") + "/" + part
    return out


def exists(url: str, storage_options: dict | None = None) -> bool:
    """True when a file or directory exists at ``url``."""
    fs, path = url_to_fs(url, storage_options)
    if not is_local(fs):
        fs.invalidate_cache(path)  # another process may have written it since we last listed
    return fs.exists(path)


def read_bytes(url: str, storage_options: dict | None = None) -> bytes:
    """Return the whole content of the file at ``url``."""
    fs, path = url_to_fs(url, storage_options)
    return fs.cat_file(path)


def backend_for(url: str, storage_options: dict | None = None) -> StorageBackend:
    """The storage backend that writes ``url`` (see ``ppoflow.infra.data.storage_backends``).

    Raises ``NoStorageBackend`` when the URL's fsspec protocol has none registered.
    """
    url = os.fspath(url)
    fs, _ = url_to_fs(url, storage_options)
    return backend_class(fs, url)(fs)


@contextlib.contextmanager
def open_atomic(url: str, storage_options: dict | None = None, *, fsync: bool = False) -> Iterator[IO[bytes]]:
    """Context manager yielding a writable binary file that is published at ``url`` on success.

    On an exception inside the ``with`` block nothing is published and no temporary file is
    left behind; the exception propagates. Parent directories are created as needed. How each
    protocol publishes atomically is its backend's (:func:`backend_for`). ``fsync=True`` (local
    files only) makes the content and the rename durable before returning (for manifests).
    """
    url = os.fspath(url)
    with backend_for(url, storage_options).open_atomic(url, fsync=fsync) as f:
        yield f


def write_bytes_atomic(
    url: str, data: bytes, storage_options: dict | None = None, *, fsync: bool = False
) -> None:
    """Write ``data`` at ``url``; readers see the old content or all of ``data``, never a part."""
    with open_atomic(url, storage_options, fsync=fsync) as f:
        f.write(data)


def read_json(url: str, storage_options: dict | None = None) -> Any:
    """Read and parse the JSON document at ``url``."""
    raw = read_bytes(url, storage_options)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{url}: not valid JSON ({exc}); rewrite it with write_json_atomic()") from exc


def write_json_atomic(url: str, obj: Any, storage_options: dict | None = None) -> None:
    """Serialise ``obj`` as indented JSON and write it atomically (and durably, if local) at ``url``."""
    try:
        text = json.dumps(obj, indent=2, allow_nan=True)
    except TypeError as exc:
        raise TypeError(f"write_json_atomic({url!r}): object is not JSON-serialisable: {exc}") from exc
    write_bytes_atomic(url, (text + "\n").encode("utf-8"), storage_options, fsync=True)


def listdir(url: str, storage_options: dict | None = None) -> list[str]:
    """Sorted names (not paths) of the entries directly under ``url``; temporary files hidden.

    A missing directory raises ``FileNotFoundError``.
    """
    fs, path = url_to_fs(url, storage_options)
    if not is_local(fs):
        fs.invalidate_cache(path)
    entries = fs.ls(path, detail=False)
    base = path.rstrip("/")
    names = []
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if entry.rstrip("/") == base or not name:
            continue
        if name.startswith(".") and TEMP_MARKER in name:
            continue
        names.append(name)
    return sorted(set(names))


def local_free_bytes(url: str) -> int | None:
    """Free bytes on the local filesystem that holds (or would hold) ``url``; None for remote storage."""
    fs, path = url_to_fs(url)
    if not is_local(fs):
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def rm(url: str, recursive: bool = False, storage_options: dict | None = None) -> None:
    """Remove the file (or with ``recursive=True`` the directory tree) at ``url``."""
    fs, path = url_to_fs(url, storage_options)
    fs.rm(path, recursive=recursive)


def join_inside(base_url: str, *parts: str) -> str:
    """:func:`join`, refusing parts that could resolve outside ``base_url``: a ``.`` or ``..``
    component (``join`` already reads a leading ``/`` of a part as relative to the base). Raises
    ``ValueError`` naming the part; stores that do not resolve ``..`` (S3 keys) are held to it too."""
    for part in parts:
        text = os.fspath(part)
        if any(component in (".", "..") for component in text.replace("\\", "/").split("/")):
            raise ValueError(f"{text!r} would leave {base_url}: a '.' or '..' path component")
    return join(base_url, *parts)
