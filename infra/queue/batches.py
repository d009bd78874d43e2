"""The batches of the rollout queue: ``queue/batches/{k:06d}/`` (batch k is iteration k's).

A producer works on batch k only while it holds the batch's lease (:class:`BatchClaim`,
``claim.json``: create-if-absent, heartbeats, taken over when its holder is gone or silent for
``asynchronous.lease_stale_after_s``). It publishes finished sequences as parts
(``part-{j:04d}.arrow``, each row with its index in the batch, ``row``), so a producer that dies
loses only its unfinished sequences and the next one samples only the rows no part holds. When
every row is there it writes the whole batch, rows in order (``batch-<owner>.arrow``: a name of its
own, so a producer that lost its lease cannot overwrite the winner's file) and then ``done.json``
with create-if-absent: the batch's record (its file, content hash, rows, data cursor, the
versions that sampled it and the producer's timings). The record is the commit point: a batch
without one is not there.

The trainer reads the record and the file (hash checked), and after commit n deletes the batches
up to n (:func:`drop_batches`); the iteration's own ``rollout.arrow`` keeps what it consumed.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.hashing import hash_file
from ppoflow.infra.experiment.lock import ExperimentLocked, Lease
from ppoflow.infra.queue.layout import QueuePaths

__all__ = [
    "BatchClaim",
    "claim_batch",
    "claim_holder",
    "publish_part",
    "finished_rows",
    "publish_batch",
    "read_record",
    "load_batch",
    "wait_record",
    "drop_batches",
    "part_versions",
    "ROW",
]

#: The column of a part that holds each row's index in the batch (dropped from the whole batch).
ROW = "row"


class BatchClaim:
    """A producer's claim on one batch: it holds a :class:`~ppoflow.infra.experiment.lock.Lease` on
    the batch's ``claim.json`` (the lease's heartbeats and takeover rules; it is not an experiment
    lock) and offers what a producer does with it."""

    what = "claim on a rollout batch"

    def __init__(
        self, url: str, owner: str, *, stale_after_s: float, log: Callable[[str], None] | None = None
    ):
        self.lease = Lease(
            url,
            owner,
            heartbeat_s=max(0.5, stale_after_s / 8),
            stale_after_s=stale_after_s,
            log=log,
            what=self.what,
        )

    def acquire(self) -> BatchClaim:
        """Take the claim (taking over a stale one); :class:`ExperimentLocked` when a live producer
        holds it."""
        self.lease.acquire()
        return self

    def check(self) -> None:
        """Raise when this producer no longer holds the claim (taken over, or not renewed in time)."""
        self.lease.check()

    def release(self) -> None:
        self.lease.release()

    def stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why ``holder`` (a claim's record) may be taken over, or None while it is live."""
        return self.lease.stale_reason(holder)


def claim_batch(paths: QueuePaths, k: int, owner: str, stale_after_s: float, log=None) -> BatchClaim | None:
    """Take the lease on batch ``k`` for ``owner`` (a producer's run id), taking over a stale one;
    None when a live producer holds it."""
    try:
        return BatchClaim(paths.claim(k), owner, stale_after_s=stale_after_s, log=log).acquire()
    except ExperimentLocked:
        return None


def claim_holder(paths: QueuePaths, k: int) -> dict[str, Any] | None:
    """The record of batch ``k``'s lease (run id, host, pid, heartbeat), or None."""
    try:
        return storage.read_json(paths.claim(k))
    except (FileNotFoundError, ValueError):
        return None


def publish_part(paths: QueuePaths, k: int, part: DataProto) -> str:
    """Publish finished rows of batch ``k`` (with their :data:`ROW` column) as its next part."""
    if ROW not in part.batch:
        raise KeyError(f"a part of batch {k} needs its rows' indices in column {ROW!r}")
    j = len(paths.parts(k))
    url = paths.part(k, j)
    part.save(url)
    return url


def finished_rows(paths: QueuePaths, k: int) -> DataProto | None:
    """The rows of batch ``k``'s published parts (ordered by row), or None when there is none."""
    urls = paths.parts(k)
    if not urls:
        return None
    rows = DataProto.concat([DataProto.load(u) for u in urls])
    order = torch.argsort(rows.batch[ROW])
    return rows[order]


def publish_batch(paths: QueuePaths, k: int, rows: DataProto, record: dict[str, Any]) -> dict[str, Any]:
    """Write batch ``k`` from all its rows (with :data:`ROW`, 0..B-1 once each) and then its record
    (``record`` plus file, hash and size). Returns the record on storage: this one, or the one
    another producer published first."""
    index = rows.batch[ROW]
    if sorted(index.tolist()) != list(range(len(rows))):
        raise ValueError(
            f"batch {k}: rows {sorted(index.tolist())[:10]}... are not each of 0..{len(rows) - 1} once"
        )
    whole = rows[torch.argsort(index)]
    whole.pop(batch_keys=[ROW])
    name = f"batch-{uuid.uuid4().hex[:8]}.arrow"
    url = storage.join_inside(paths.batch_dir(k), name)
    whole.save(url)
    fs, path = storage.url_to_fs(url)
    size, digest = hash_file(fs, path)
    full = {
        **record,
        "batch": k,
        "file": name,
        "xxh3": digest,
        "bytes": size,
        "rows": len(whole),
        "producer": {"host": socket.gethostname(), "pid": os.getpid(), **record.get("producer", {})},
        "finished_at": time.time(),
    }
    created = storage.backend_for(paths.done(k)).create(paths.done(k), json.dumps(full).encode())
    if created is None:  # another producer finished it first: its file is the batch
        storage.rm(url)
        existing = read_record(paths, k)
        assert existing is not None
        return existing
    return full


def read_record(paths: QueuePaths, k: int) -> dict[str, Any] | None:
    """Batch ``k``'s record (``done.json``), or None while it is not complete."""
    try:
        return storage.read_json(paths.done(k))
    except FileNotFoundError:
        return None


def load_batch(paths: QueuePaths, k: int, record: dict[str, Any]) -> tuple[DataProto, str]:
    """Batch ``k`` (its content hash checked against the record) and its file's URL."""
    url = storage.join_inside(paths.batch_dir(k), record["file"])
    fs, path = storage.url_to_fs(url)
    size, digest = hash_file(fs, path)
    if digest != record["xxh3"] or size != record["bytes"]:
        raise OSError(
            f"{url} holds {size} bytes with hash {digest}, its record says {record['bytes']} bytes, "
            f"{record['xxh3']}: the batch file is damaged; delete {paths.batch_dir(k)} so it is sampled again"
        )
    return DataProto.load(url), url


def wait_record(
    paths: QueuePaths,
    k: int,
    *,
    poll_s: float,
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Batch ``k``'s record once it is published. ``check()`` runs between looks (it raises to end
    the wait: a lost lock, a producer that died); ``TimeoutError`` after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        record = read_record(paths, k)
        if record is not None:
            return record
        check()
        if time.monotonic() - t0 > timeout_s:
            holder = claim_holder(paths, k)
            who = (
                f"held by {holder.get('run_id')} on {holder.get('host')}"
                if holder
                else "not claimed by any producer"
            )
            raise TimeoutError(
                f"batch {k} was not published within {timeout_s:.0f} s (it is {who}): is a ppo-rollout "
                "flow running for this experiment? (asynchronous.producer.start, docs/async.md)"
            )
        time.sleep(poll_s)


def drop_batches(paths: QueuePaths, keep: Callable[[int, dict[str, Any] | None], bool]) -> list[int]:
    """Delete the batches for which ``keep(k, record)`` is False; returns their numbers."""
    dropped = []
    for k in paths.batch_numbers():
        if not keep(k, read_record(paths, k)):
            storage.rm(paths.batch_dir(k), recursive=True)
            dropped.append(k)
    return dropped


def part_versions(paths: QueuePaths, k: int) -> int | None:
    """The newest policy version in batch ``k``'s parts (None: no part)."""
    rows = finished_rows(paths, k)
    if rows is None:
        return None
    versions = rows.batch["token_versions"]
    return int(versions.max()) if versions.numel() else None
