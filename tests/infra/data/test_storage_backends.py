"""ppoflow.infra.data.storage_backends: create-if-absent, replace-if-match, delete-if-match and atomic
publish on local files, ``memory://`` and S3 (moto's server), and the error of a protocol without one.

The concurrency tests are the claims that matter: of many creators exactly one wins, and a counter
incremented by many writers through read_versioned + replace (retrying on a stale token) ends at
the number of increments, which a check-then-write would not (it loses updates). On S3 they run
with moto's request handling unpreempted (``tests.support.s3_server.unpreempted_requests``: moto's
own check-then-store is not atomic across its threads; real S3's is).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ppoflow.infra.data import storage
from ppoflow.infra.data.storage_backends import MemoryBackend, base
from ppoflow.infra.experiment.lock import ExperimentLock
from tests.support.paths import ROOT
from tests.support.s3_server import unpreempted_requests


@pytest.fixture(params=["local", "memory", "s3"])
def where(request, tmp_path):
    """A fresh directory URL on each storage."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://backends-{uuid.uuid4().hex[:8]}"
    s3 = request.getfixturevalue("s3_server")
    return f"{s3['url']}/backends-{uuid.uuid4().hex[:8]}"


def test_of_many_concurrent_creators_exactly_one_wins(where):
    url = storage.join(where, "leases", "batch-000001.json")
    backend = storage.backend_for(url)
    n = 6
    start = threading.Barrier(n)
    results: list[tuple[int, str | None]] = []

    def create(i: int) -> None:
        start.wait()
        results.append((i, backend.create(url, f"writer {i}".encode())))

    with unpreempted_requests() if url.startswith("s3://") else contextlib.nullcontext():
        threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    winners = [(i, token) for i, token in results if token is not None]
    assert len(results) == n and len(winners) == 1, results
    (winner, token) = winners[0]
    assert backend.read_versioned(url) == (f"writer {winner}".encode(), token)
    assert storage.read_bytes(url) == f"writer {winner}".encode()
    assert storage.listdir(storage.join(where, "leases")) == ["batch-000001.json"]


def test_replace_and_delete_only_at_the_version_read(where):
    url = storage.join(where, "lease.json")
    backend = storage.backend_for(url)
    assert backend.replace(url, b"v1", "no-such-version") is None  # nothing there
    assert not backend.delete(url, "no-such-version")
    with pytest.raises(FileNotFoundError):
        backend.read_versioned(url)
    t1 = backend.create(url, b"v1")
    assert t1 is not None and backend.read_versioned(url) == (b"v1", t1)
    assert backend.create(url, b"again") is None
    t2 = backend.replace(url, b"v2", t1)
    assert t2 is not None and t2 != t1
    assert backend.replace(url, b"v3", t1) is None  # a stale token
    assert not backend.delete(url, t1)
    assert backend.read_versioned(url) == (b"v2", t2)
    # a blind publish is a new version too: the token read before it is stale after it
    storage.write_bytes_atomic(url, b"blind")
    data, t3 = backend.read_versioned(url)
    assert data == b"blind" and backend.replace(url, b"v4", t2) is None
    assert backend.delete(url, t3)
    assert not storage.exists(url)
    assert not backend.delete(url, t3)
    assert backend.create(url, b"v5") is not None  # free again
    assert storage.listdir(where) == ["lease.json"]  # no temporary or guard file left


def increment(url: str, times: int) -> None:
    """Add 1 to the counter at ``url`` ``times`` times: read it with its version, write the next
    value only at that version, and read again when another writer got in first."""
    backend = storage.backend_for(url)
    done = 0
    while done < times:
        data, token = backend.read_versioned(url)
        if backend.replace(url, str(int(data) + 1).encode(), token) is not None:
            done += 1


def test_concurrent_increments_through_replace_lose_nothing(where):
    """Writers increment one counter by read_versioned + replace, retrying on a stale token: the
    count ends at the number of increments. Local files: separate processes (the flock'd guard
    across processes); memory and S3: threads of this process."""
    url = storage.join(where, "counter")
    assert storage.backend_for(url).create(url, b"0") is not None
    writers, times = 3, 8
    if url.startswith(("memory://", "s3://")):
        with unpreempted_requests() if url.startswith("s3://") else contextlib.nullcontext():
            threads = [threading.Thread(target=increment, args=(url, times)) for _ in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    else:
        code = f"from tests.infra.data.test_storage_backends import increment; increment({url!r}, {times})"
        env = {**os.environ, "PYTHONPATH": ROOT}
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT) for _ in range(writers)]
        assert [p.wait(timeout=120) for p in procs] == [0] * writers
    assert storage.read_bytes(url) == str(writers * times).encode()


def test_an_aborted_atomic_publish_leaves_nothing(where):
    url = storage.join(where, "dir", "data.bin")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.backend_for(url).open_atomic(url) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not storage.exists(url)
    with storage.backend_for(url).open_atomic(url, fsync=True) as f:
        f.write(b"whole")
    assert storage.read_bytes(url) == b"whole"
    assert storage.listdir(storage.join(where, "dir")) == ["data.bin"]


class ToyFileSystem(MemoryFileSystem):
    """An fsspec filesystem of a protocol ppoflow has no backend for."""

    protocol = "ppoflowtoy"


def test_a_protocol_without_a_backend_is_refused_by_name(monkeypatch):
    fsspec.register_implementation("ppoflowtoy", ToyFileSystem, clobber=True)
    monkeypatch.setattr(base, "_BACKENDS", dict(base._BACKENDS))  # registrations end with the test
    root = f"ppoflowtoy://toy-{uuid.uuid4().hex[:8]}"
    url, lock = f"{root}/iterations/000001/rollout.arrow", f"{root}/lock.json"
    ToyFileSystem().pipe_file(ToyFileSystem._strip_protocol(f"{root}/readme"), b"hi")
    assert storage.read_bytes(f"{root}/readme") == b"hi"  # reads are plain fsspec
    needle = (
        r"storage protocol 'ppoflowtoy' has no ppoflow storage backend, so there is no "
        r"create-if-absent, replace-if-match \(with delete-if-match\) or atomic publish for it "
        r".*register_backend\('ppoflowtoy', YourBackend\)"
    )
    with pytest.raises(storage.NoStorageBackend, match=needle):
        storage.write_bytes_atomic(url, b"x")
    with pytest.raises(storage.NoStorageBackend, match=needle):
        ExperimentLock(lock, "run-a").acquire()
    assert not storage.exists(url)
    # simplecache:: in front of a storage with a backend is another protocol, refused the same way
    with pytest.raises(storage.NoStorageBackend, match="'simplecache' has no ppoflow storage backend"):
        storage.write_bytes_atomic("simplecache::memory://x/y", b"x")

    class Half(storage.StorageBackend):
        def create(self, url, data):
            return None

    with pytest.raises(
        TypeError, match=r"Half does not implement delete, open_atomic, read_versioned, replace"
    ):
        storage.register_backend("ppoflowtoy", Half)
    # a registered backend makes the protocol writable, the lock included
    storage.register_backend("ppoflowtoy", MemoryBackend)
    storage.write_bytes_atomic(url, b"x")
    assert storage.read_bytes(url) == b"x"
    with ExperimentLock(lock, "run-a"):
        assert storage.exists(lock)
    assert not storage.exists(lock)
