"""Rank side of checkpoint writes: synchronous, or staged to host memory and written in the background.

    writer = CheckpointWriter()                   # one per trained model, on every rank of its group
    writer.save(url, model, opt, sched, extra)                    # returns once published
    writer.save(url, model, opt, sched, extra, background=True)   # returns once staged (host copy)
    ...                                                           # training goes on meanwhile
    writer.wait()                                 # the background write's result (raises if it failed)
    with writer.paused(): ...                     # the write thread waits while the block runs

Every ``save`` is collective (every rank of the group calls it). A background save:

1. waits for the previous background write of this writer (one in flight: its host buffers are
   reused), removes an old marker at ``url`` (rank 0), and captures the non-tensor state (optimizer
   param groups, LR scheduler, ``extra``, this rank's RNG) now;
2. stages the tensors into host memory (:class:`HostStager`: pinned on CUDA; the buffers are
   allocated once and reused by the next saves), so training may change the live tensors at once;
3. writes in a thread of its own: ``dcp.save`` over a gloo process group of its own (DCP's collectives
   must not interleave with the training's on the default group: that deadlocks), model and
   optimizer as two DCP directories, each file hashed as it is written
   (:class:`~ppoflow.infra.checkpoint.integrity.HashingFileSystem`), then each rank's RNG file;
   a failed DCP write (every rank sees it) is retried from the staged copy ``attempts`` times;
4. gathers every rank's file records and rank 0 publishes the marker, or, if any rank failed,
   ``ppoflow_failed.json`` with the errors. A rank that dies mid-write leaves neither: the checkpoint
   stays incomplete and loads refuse it.

Layout written (format v2)::

    model/.metadata, model/__<rank>_0.distcp     {"model": {hf_name: tensor}}
    optim/.metadata, optim/__<rank>_0.distcp     {"optim": {hf_name: {exp_avg, ...}}}  (not for a
                                                 never-stepped optimizer: its state is empty)
    rng/rank_<rank>.json                         each rank's RNG states
    ppoflow_complete.json                        the marker, written last (see ``marker``)
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ppoflow.infra.checkpoint._dist import all_gather_json, barrier, rank_world
from ppoflow.infra.checkpoint.integrity import HashingFileSystem
from ppoflow.infra.checkpoint.marker import (
    FAILED,
    FORMAT,
    MARKER,
    CheckpointError,
    CheckpointWriteFailed,
    options,
    write_failure,
    write_marker,
)
from ppoflow.infra.checkpoint.staging import HostStager
from ppoflow.infra.checkpoint.state import MODEL, OPTIM, collect, enc, rng_file, rng_state
from ppoflow.infra.data import storage
from ppoflow.infra.data.hashing import ALGORITHM, hash_bytes, hash_file
from ppoflow.infra.runtime import faults

__all__ = ["CheckpointWriter", "dcp_call", "make_reader", "make_writer", "FAULT_POINT"]

_LOG = logging.getLogger("ppoflow.checkpoint")

#: ``PPOFLOW_FAULT`` point fired when a rank opens a checkpoint file for writing (``rank_exit``:
#: the rank dies mid-write; ``rank_raise``: that write fails inside DCP).
FAULT_POINT = faults.CHECKPOINT_WRITE


def _local_path(url: str) -> str | None:
    """The OS path of a local URL (plain path or ``file://``), else None."""
    return url if "://" not in url else url[len("file://") :] if url.startswith("file://") else None


def _marker(
    got: Any, world: int, extra: dict | None, lr_scheduler: Any, dtype: torch.dtype | None
) -> dict[str, Any]:
    """The marker's content but the file records (added once every rank has written)."""
    return {
        "format": FORMAT,
        "world_size": world,
        "hf_key_prefix": got.names.prefix,
        "layout": {"model": MODEL, "optim": OPTIM if got.optim is not None else None},
        "weights_only": got.optim_json is None,
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "extra": enc(dict(extra or {}), "extra"),
        "optimizer": got.optim_json,
        "lr_scheduler": None
        if lr_scheduler is None
        else enc(lr_scheduler.state_dict(), "lr_scheduler.state_dict()"),
        "torch": torch.__version__,
    }


def _cast(tree: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``tree`` with its floating-point tensors (DTensors too: each rank casts its shard) in ``dtype``."""
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in tree.items()
    }


def _space_note(url: str, trees: dict[str, dict]) -> str:
    """A note for a failed write to a local filesystem with less room left than this rank's share
    of the checkpoint (a shard cut short by a full disk can surface as a failed size check rather
    than ``ENOSPC``); else ``""``."""
    free, share = storage.local_free_bytes(url), _nbytes(trees)
    if free is None or free >= share:
        return ""
    return f" [{os.strerror(errno.ENOSPC)}: {free} bytes free there, this rank's share is {share} bytes]"


def _nbytes(tree: Any) -> int:
    """Bytes of a state tree's tensors on this rank (a DTensor counts its local shard)."""
    if isinstance(tree, dict):
        return sum(_nbytes(value) for value in tree.values())
    if isinstance(tree, torch.Tensor):
        local = tree.to_local() if hasattr(tree, "to_local") else tree
        return local.numel() * local.element_size()
    return 0


def make_writer(url: str, opts: dict, threads: int = 1) -> Any:
    """DCP's writer for ``url``: its local one for paths, the fsspec one (with ``opts``) otherwise;
    ``threads`` > 1 writes that many files per rank in parallel."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    local = _local_path(url)
    if local is not None:
        return FileSystemWriter(local, single_file_per_rank=True, overwrite=True, thread_count=threads)
    # Never pass checkpoint_id= together with this writer: DCP would rebuild it without ``opts``.
    return FsspecWriter(url, single_file_per_rank=True, overwrite=True, thread_count=threads, **opts)


def make_reader(url: str, opts: dict) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    local = _local_path(url)
    return FileSystemReader(local) if local is not None else FsspecReader(url, **opts)


def dcp_call(what: str, url: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    """Run a DCP call, turning its ``CheckpointException`` (a BaseException) into CheckpointError."""
    try:
        with warnings.catch_warnings():  # DCP warns on every single-process call; that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
            warnings.filterwarnings(
                "ignore", message="Detected an existing checkpoint"
            )  # replaced on purpose
            fn(*args, **kwargs)
    except CheckpointException as exc:
        _LOG.debug("%s checkpoint %s failed: %s", what, url, exc)
        causes = "; ".join(
            f"rank {rank}: {type(err).__name__}: {err}" for rank, (err, _) in sorted(exc.failures.items())
        )
        raise CheckpointError(f"{what} checkpoint {url} failed ({causes})") from exc


class CheckpointWriter:
    """Writes one model's checkpoints on one rank; at most one background write in flight.

    Args:
        attempts: DCP writes tried per directory before the save fails (storage hiccups).
        backoff_s: seconds before the second attempt (doubled for each next one).
        threads: files each rank writes in parallel (DCP's ``thread_count``).
    """

    def __init__(self, attempts: int = 3, backoff_s: float = 1.0, threads: int = 1):
        self.attempts, self.backoff_s = max(1, int(attempts)), float(backoff_s)
        self.threads = max(1, int(threads))
        self._pg: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._stager: Any = None
        self._job: tuple[str, Future] | None = None
        self._running = threading.Event()  # cleared while paused(): the write thread waits
        self._running.set()
        self._pauses = 0
        self._pause_lock = threading.Lock()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold a background write for the length of the block: the write thread stops at its next
        file write and waits (without the GIL) until the block ends. For short, latency-bound work
        on the rank's main thread (the weight push into the engine) that the write thread's Python
        would otherwise slow down, as it competes for the GIL (figures: ``docs/benchmarks.md``).
        Nestable; a no-op when nothing is being written. Never ``save`` inside the block: its
        writes would wait for the block to end."""
        with self._pause_lock:
            self._pauses += 1
            self._running.clear()
        try:
            yield
        finally:
            with self._pause_lock:
                self._pauses -= 1
                if self._pauses == 0:
                    self._running.set()

    @property
    def pending(self) -> str | None:
        """The URL of the background write in flight (or finished but not yet waited for)."""
        return self._job[0] if self._job is not None else None

    # ------------------------------------------------------------------ saving
    def save(
        self,
        url: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        storage_options: dict | None = None,
        background: bool = False,
        dtype: torch.dtype | None = None,
    ) -> dict[str, Any]:
        """Save model (+ optimizer, LR scheduler, ``extra``, RNG) to ``url``; collective.

        ``dtype`` (weights only: no ``optimizer``): write the model's floating-point tensors cast
        to it, rounding to nearest as a narrower engine's own load of them would (a policy version
        for engines that run in bf16: half the bytes to write and to read).

        Returns ``{waited_s, staged_s}`` (background: the write goes on; :meth:`wait` for it) or
        ``{waited_s, write_s, bytes}`` once the checkpoint is published. ``waited_s``: time spent
        waiting for this writer's previous background write.
        """
        if dtype is not None and optimizer is not None:
            raise ValueError("a checkpoint in another dtype is weights only: pass no optimizer")
        t0 = time.perf_counter()
        self.wait(raise_errors=False)  # its outcome is its own marker or failure record
        waited = time.perf_counter() - t0
        rank, world = rank_world()
        opts = options(url, storage_options)
        got = collect(model, optimizer, for_save=True)
        if dtype is not None:
            got.model = {sub: _cast(tree, dtype) for sub, tree in got.model.items()}
        marker = _marker(got, world, extra, lr_scheduler, dtype)
        trees = {MODEL: got.model, **({OPTIM: got.optim} if got.optim is not None else {})}
        rng = rng_state()
        if rank == 0:
            for name in (MARKER, FAILED):
                target = storage.join(url, name)
                if storage.exists(target, opts):
                    storage.rm(target, storage_options=opts)
        barrier()
        if not background:
            result = self._write(url, trees, marker, rng, opts, None, time.perf_counter())
            return {"waited_s": waited, **result}
        t1 = time.perf_counter()
        if self._stager is None:
            self._stager = HostStager()
        key = "" if dtype is None else f":{dtype}"  # snapshots and narrower versions: buffers each
        staged = {sub: self._stager.stage(sub + key, tree) for sub, tree in trees.items()}
        staged_s = time.perf_counter() - t1
        group = self._group()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppoflow-ckpt-write")
        self._job = (url, self._pool.submit(self._write, url, staged, marker, rng, opts, group, t1))
        return {"waited_s": waited, "staged_s": staged_s}

    def _group(self) -> Any:
        """The writer's own gloo group (created collectively on first use)."""
        if self._pg is None and dist.is_available() and dist.is_initialized():
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _write(
        self,
        url: str,
        trees: dict[str, dict],
        marker: dict[str, Any],
        rng: dict[str, Any],
        opts: dict,
        group: Any,
        t0: float,
    ) -> dict[str, Any]:
        """Write the trees and this rank's RNG file, then publish the marker (rank 0); collective
        on ``group``. Every rank reaches the gather, whatever failed, so none is left waiting."""
        rank, _ = rank_world(group)
        records: dict[str, dict[str, Any]] = {}
        error = None
        try:
            for sub, tree in trees.items():
                records.update(self._dcp_save(url, sub, tree, opts, group))
            data = json.dumps(rng).encode()
            name = rng_file(rank)
            storage.write_bytes_atomic(storage.join(url, name), data, opts)
            records[name] = {"size": len(data), ALGORITHM: hash_bytes(data)}
        except BaseException as exc:  # noqa: BLE001 - reported through the gather and the failure record
            error = (
                str(exc) if isinstance(exc, CheckpointError) else f"rank {rank}: {type(exc).__name__}: {exc}"
            ) + _space_note(url, trees)
        everyone = all_gather_json({"files": records, "error": error}, group)
        errors = list(
            dict.fromkeys(e["error"] for e in everyone if e["error"])
        )  # DCP's: the same on every rank
        files = {name: rec for e in everyone for name, rec in e["files"].items()}
        total = sum(int(r["size"]) for r in files.values())
        write_s = time.perf_counter() - t0
        published = None
        if rank == 0:
            if errors:
                write_failure(url, errors, opts)
            else:
                done = {**marker, "files": files, "bytes": total, "write_s": write_s, "saved_at": time.time()}
                try:
                    faults.rank_point(faults.CHECKPOINT_PUBLISH)
                    write_marker(url, done, opts)
                except BaseException as exc:  # noqa: BLE001 - every rank must hear of it (below)
                    published = f"rank 0: publishing {MARKER}: {type(exc).__name__}: {exc}"
                    write_failure(url, [published], opts)
        # every rank learns whether the marker is there: raising on rank 0 alone would leave the
        # others waiting
        errors += [e["error"] for e in all_gather_json({"error": published}, group) if e["error"]]
        if errors:
            raise CheckpointWriteFailed(f"writing checkpoint {url} failed: {'; '.join(errors)}")
        _LOG.info("saved checkpoint %s (%d bytes) in %.2fs", url, total, write_s)
        return {"url": url, "write_s": write_s, "bytes": total}

    def _dcp_save(self, url: str, sub: str, tree: dict, opts: dict, group: Any) -> dict[str, dict[str, Any]]:
        """``dcp.save`` of ``tree`` into ``url/sub`` (retried); this rank's files -> {name: record}."""
        target = storage.join(url, sub)
        for attempt in range(1, self.attempts + 1):
            writer = make_writer(target, opts, self.threads)
            hashing = HashingFileSystem(
                writer.fs, on_open=lambda path: faults.rank_point(FAULT_POINT), gate=self._running
            )
            writer.fs = hashing
            try:
                dcp_call("saving", target, dcp.save, tree, storage_writer=writer, process_group=group)
                break
            except CheckpointError as exc:
                if attempt == self.attempts:
                    raise
                delay = self.backoff_s * 2 ** (attempt - 1)
                _LOG.warning("%s (attempt %d of %d); retrying in %.1fs", exc, attempt, self.attempts, delay)
                time.sleep(delay)
        out = {}
        for path, rec in hashing.records.items():
            name = f"{sub}/{os.path.basename(path.rstrip('/'))}"
            if rec is None:  # a stream the hasher could not follow: read the file back
                fs, fpath = storage.url_to_fs(storage.join(url, name), opts)
                rec = hash_file(fs, fpath)
            out[name] = {"size": rec[0], ALGORITHM: rec[1]}
        return out

    # ------------------------------------------------------------------ waiting
    def wait(self, raise_errors: bool = True) -> dict[str, Any] | None:
        """Block until the background write ends; its result (None when there was none).

        A failed write raises (``raise_errors``) or returns ``{url, error}``.
        """
        if self._job is None:
            return None
        url, future = self._job
        try:
            return future.result()
        except BaseException as exc:
            if raise_errors:
                raise
            return {"url": url, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._job = None

    def status(self) -> dict[str, Any] | None:
        """The background write without waiting for it: None when there is none, else ``{url,
        running}`` and, once it has failed, ``error`` (the write stays to be :meth:`wait`-ed for)."""
        if self._job is None:
            return None
        url, future = self._job
        if not future.done():
            return {"url": url, "running": True}
        exc = future.exception()
        out: dict[str, Any] = {"url": url, "running": False}
        if exc is not None:
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    def close(self) -> None:
        """Finish the write in flight, then free the thread and the staging buffers."""
        self.wait(raise_errors=False)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
