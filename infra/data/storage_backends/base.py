"""The contract every storage backend meets, and the registry that maps fsspec protocols to them.

A backend writes to one kind of storage through its fsspec filesystem with four primitives:

    create(url, data) -> token | None              create-if-absent: None when something is there
    replace(url, data, token) -> token | None      replace-if-match: None when the object is not at
                                                   version ``token`` (changed, or gone)
    read_versioned(url) -> (data, token)           the content and its version, read together
    delete(url, token) -> bool                     delete-if-match: False when not at ``token``
    open_atomic(url, fsync=False)                  atomic publish: a writable file that readers see
                                                   whole or not at all, published only on success

A token is an opaque string naming one version of one object; a writer compares tokens only for
equality, and only with tokens of the same backend. ``create``, ``replace`` and ``delete`` are for
small records that several processes change (the experiment lock, leases): each one is a single
atomic step against the storage. ``open_atomic`` is for data (Arrow files, manifests) and writes
blindly: it never fails because of a concurrent writer, and a blind write racing a ``replace``
lands before it or after it (a path written with ``replace`` is best written only with
``create``/``replace``/``delete``).

Backends register by fsspec protocol (:func:`register_backend`); a filesystem whose protocols
have none is refused with :class:`NoStorageBackend` at the first write, naming what is missing.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import uuid
from collections.abc import Iterable
from typing import IO, Any

__all__ = [
    "StorageBackend",
    "NoStorageBackend",
    "register_backend",
    "registered_protocols",
    "backend_class",
    "content_token",
    "temp_name",
    "TEMP_MARKER",
]

#: Substring present in every temporary name the backends write (hidden from ``storage.listdir``).
TEMP_MARKER = ".tmp-"

PRIMITIVES = "create-if-absent, replace-if-match (with delete-if-match) or atomic publish"


class NoStorageBackend(ValueError):
    """A URL whose fsspec protocol has no registered storage backend, so it cannot be written."""


class StorageBackend(abc.ABC):
    """Writes to one kind of storage (see the module docstring for the contract).

    A backend is built on the fsspec filesystem of the URL it writes (``fs``, with the storage
    options it was made with); its methods take URLs or paths of that filesystem.
    """

    def __init__(self, fs: Any):
        self.fs = fs

    def path(self, url: str) -> str:
        """The filesystem's own path of ``url`` (a URL or a path of ``self.fs``)."""
        return self.fs._strip_protocol(url)

    @abc.abstractmethod
    def create(self, url: str, data: bytes) -> str | None:
        """Create the object at ``url`` holding ``data`` if nothing is there, in one atomic step.

        Returns the new version's token, or None when an object already exists (the other writer
        won). Readers see nothing or all of ``data``."""

    @abc.abstractmethod
    def replace(self, url: str, data: bytes, token: str) -> str | None:
        """Overwrite the object at ``url`` with ``data`` only if it is still at version ``token``,
        in one atomic step.

        Returns the new version's token, or None when the object is at another version or gone.
        A request retried by the storage client after its first attempt landed also gets None:
        read the object to see whose content it holds."""

    @abc.abstractmethod
    def read_versioned(self, url: str) -> tuple[bytes, str]:
        """The content of the object at ``url`` and the token of that very version (one read:
        the token never belongs to another version). ``FileNotFoundError`` when there is none."""

    @abc.abstractmethod
    def delete(self, url: str, token: str) -> bool:
        """Delete the object at ``url`` only if it is at version ``token``; False otherwise
        (another version, or nothing there)."""

    @abc.abstractmethod
    def open_atomic(self, url: str, *, fsync: bool = False) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A context manager yielding a writable binary file that is published at ``url`` when the
        block ends without an exception; on an exception nothing is published and nothing is left
        behind. Parent directories are made as needed. ``fsync``: make the publication durable
        before returning, where the storage distinguishes (local files)."""


_BACKENDS: dict[str, type[StorageBackend]] = {}


def register_backend(protocols: str | Iterable[str], backend: type[StorageBackend]) -> None:
    """Make ``backend`` the writer of every URL whose fsspec filesystem has one of ``protocols``
    (e.g. ``("gs", "gcs")``). A later registration of a protocol replaces the earlier one."""
    if not (isinstance(backend, type) and issubclass(backend, StorageBackend)):
        raise TypeError(f"register_backend needs a StorageBackend subclass, got {backend!r}")
    missing = sorted(getattr(backend, "__abstractmethods__", ()))
    if missing:
        raise TypeError(
            f"storage backend {backend.__name__} does not implement {', '.join(missing)}: a backend "
            f"provides every one of {PRIMITIVES} (see ppoflow.infra.data.storage_backends.base)"
        )
    names = [protocols] if isinstance(protocols, str) else list(protocols)
    for name in names:
        _BACKENDS[name.rstrip(":/").lower()] = backend


def registered_protocols() -> list[str]:
    """The protocols that have a backend, sorted."""
    return sorted(_BACKENDS)


def _protocols(fs: Any) -> list[str]:
    proto = fs.protocol
    return [p.lower() for p in ([proto] if isinstance(proto, str) else proto)]


def backend_class(fs: Any, url: str) -> type[StorageBackend]:
    """The backend registered for ``fs`` (the filesystem of ``url``); :class:`NoStorageBackend`
    naming the protocol, what is missing and how to add it when there is none."""
    protocols = _protocols(fs)
    for name in protocols:
        if name in _BACKENDS:
            return _BACKENDS[name]
    shown = "/".join(protocols) or type(fs).__name__
    raise NoStorageBackend(
        f"cannot write {url}: storage protocol {shown!r} has no ppoflow storage backend, so there "
        f"is no {PRIMITIVES} for it (registered: {', '.join(registered_protocols())}). Use one of "
        "those, or add a backend: subclass ppoflow.infra.data.storage_backends.StorageBackend and "
        f"call ppoflow.infra.data.storage_backends.register_backend({protocols[0]!r}, YourBackend) "
        "(docs/internals.md, 'Adding a storage backend')"
    )


def content_token(data: bytes) -> str:
    """A version token made from the content itself (SHA-256), for storages without versions."""
    return hashlib.sha256(data).hexdigest()


def temp_name(path: str) -> str:
    """A fresh temporary name next to ``path``: ``.<name>.tmp-<random>`` in the same directory."""
    head, _, name = path.rpartition("/")
    temp = f".{name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}"
    return f"{head}/{temp}" if head else temp
