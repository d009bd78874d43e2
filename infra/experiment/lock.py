"""One run at a time per experiment: a lock object at the experiment root (``lock.json``).

    with ExperimentLock(paths.lock, run_id=flow_run_id):
        ...                                   # run iterations; lock.check() before committing

The lock holds ``{run_id, host, pid, pid_start, token, acquired_at, heartbeat_at}``. A background
thread refreshes ``heartbeat_at`` every ``heartbeat_s``. A second run finds the lock and is refused
with :class:`ExperimentLocked` (naming the owner and what to do), unless the lock is stale:

- its owner was on this host and its pid is gone (or reused: the process start time differs),
- its heartbeat is older than ``stale_after_s`` (an owner on another host that died),
- or it belongs to the same run id (a retried flow run whose previous attempt died).

A stale lock is taken over. Every step is one primitive of the storage's backend
(``ppoflow.infra.data.storage_backends``, the same for every protocol):

- taking the lock is a create-if-absent of the whole record (fails if a lock exists);
- a heartbeat, and the takeover of a stale lock, is a replace-if-match against the version read
  (an S3 ETag, a local file's content hash), so a lock is never overwritten blindly and of two
  runs taking over one stale lock at once only one gets it;
- releasing is a delete-if-match of the version last read (only this run's lock is deleted).

How atomic each primitive is on each storage is its backend's docstring (local files: link(2)
and a flock'd rename; S3: conditional requests; ``memory://``: one process-wide lock). A storage
whose protocol has no backend is refused when the lock is first taken (``NoStorageBackend``),
never locked with weaker semantics.

If the heartbeat thread finds the lock owned by someone else (it was taken over after a long
stall), :attr:`lost` becomes True and :meth:`check` raises: the flow stops before committing.
The lock is a lease: when renewals fail or hang (a full disk, storage errors, a storage that does
not answer) until one heartbeat before ``stale_after_s`` — when another run may take it over —
:attr:`lost` becomes True as well and :meth:`check` raises :class:`LeaseExpired` naming the renewal error. Every task
checks the lock before it starts and before it records its result.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Self

from ppoflow.infra.data import storage

__all__ = ["Lease", "ExperimentLock", "ExperimentLocked", "LeaseExpired", "HEARTBEAT_S", "STALE_AFTER_S"]

HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0


class ExperimentLocked(RuntimeError):
    """Another live run holds the experiment (or took it over from this run)."""


class LeaseExpired(ExperimentLocked):
    """This run could not renew its lock before another run could count it as stale: it stops
    writing, so a takeover never makes two writers."""


def _pid_start(pid: int) -> str | None:
    """The process start time (clock ticks since boot) from /proc, to detect pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start is None or _pid_start(pid) in (None, start)


class Lease:
    """A lease on one record of storage that several processes compete for (the module docstring's
    rules: create-if-absent, heartbeats, takeover of a stale holder, delete-if-match). ``what``
    names the record in every message: the experiment lock is one lease, a rollout producer's
    claim on a batch holds another (``ppoflow.infra.queue.batches.BatchClaim``)."""

    what = "lease"

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        log: Callable[[str], None] | None = None,
        what: str | None = None,
    ):
        if what is not None:
            self.what = what
        self.url, self.run_id = url, str(run_id)
        self.heartbeat_s, self.stale_after_s = float(heartbeat_s), float(stale_after_s)
        self.log = log or (lambda msg: None)
        self._backend: storage.StorageBackend | None = None  # the storage's, at the first acquire
        self.token = uuid.uuid4().hex
        self.lost = False
        self.lost_reason: str | None = None
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held = False

    # ------------------------------------------------------------------ content
    def _content(self, acquired_at: float | None = None) -> bytes:
        now = time.time()
        pid = os.getpid()
        return json.dumps(
            {
                "run_id": self.run_id,
                "host": socket.gethostname(),
                "pid": pid,
                "pid_start": _pid_start(pid),
                "token": self.token,
                "acquired_at": acquired_at or now,
                "heartbeat_at": now,
            }
        ).encode()

    def _storage(self) -> storage.StorageBackend:
        """The storage backend of the lock's URL (``NoStorageBackend`` when its protocol has none)."""
        if self._backend is None:
            self._backend = storage.backend_for(self.url)
        return self._backend

    def _read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(content, version token) of the lock on storage, or (None, None) if there is none."""
        try:
            raw, version = self._storage().read_versioned(self.url)
        except FileNotFoundError:
            return None, None
        try:
            owner = json.loads(raw)
        except ValueError:
            owner = None
        if not isinstance(owner, dict):
            owner = {"run_id": "?", "heartbeat_at": 0.0}  # unreadable: treat as stale
        return owner, version

    # ------------------------------------------------------------------ API
    def stale_reason(self, owner: dict[str, Any]) -> str | None:
        """Why ``owner``'s lock may be taken over, or None if its owner looks alive."""
        if owner.get("run_id") == self.run_id:
            return f"it belongs to this same run ({self.run_id}), from an earlier attempt"
        age = time.time() - float(owner.get("heartbeat_at") or 0.0)
        if owner.get("host") == socket.gethostname() and owner.get("pid") is not None:
            if not _pid_alive(int(owner["pid"]), owner.get("pid_start")):
                return f"its process {owner['pid']} on this host is gone"
        if age > self.stale_after_s:
            return f"its last heartbeat was {age:.0f} s ago (> {self.stale_after_s:.0f} s)"
        return None

    def acquire(self) -> Self:
        """Take the lock, taking over a stale one; raise :class:`ExperimentLocked` otherwise."""
        backend = self._storage()
        for _ in range(5):
            if backend.create(self.url, self._content()) is not None:
                return self._started()
            owner, version = self._read()
            if owner is None or version is None:
                continue  # released between our attempts
            reason = self.stale_reason(owner)
            if reason is None:
                age = time.time() - float(owner.get("heartbeat_at") or 0.0)
                raise ExperimentLocked(
                    f"experiment lock {self.url} is held by flow run {owner.get('run_id')} on host "
                    f"{owner.get('host')} (pid {owner.get('pid')}), last heartbeat {age:.0f} s ago: "
                    f"two runs of one experiment must not overlap. Wait for that run to finish or "
                    f"cancel it (prefect flow-run cancel {owner.get('run_id')}); if it died on "
                    f"another host its lock expires {self.stale_after_s:.0f} s after its last "
                    f"heartbeat (or delete {self.url} once you are sure it is dead)."
                )
            self.log(f"taking over the stale {self.what} of run {owner.get('run_id')}: {reason}")
            if backend.replace(self.url, self._content(), version) is not None:
                return self._started()  # the takeover is one conditional write
        raise ExperimentLocked(
            f"could not take the experiment lock {self.url}: it kept changing "
            f"hands; another run is starting on this experiment"
        )

    def _started(self) -> Self:
        self._held, self.lost, self.lost_reason = True, False, None
        self._acquired_at = self._renewed_at = time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="ppoflow-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    @property
    def renewed_at(self) -> float:
        """When this run last wrote its heartbeat (or took the lock), in ``time.time()`` seconds."""
        return self._renewed_at

    def _lease_end(self) -> float:
        """When this run stops writing if no renewal succeeds before: one heartbeat before another
        run may count the lock as stale."""
        return self._renewed_at + self.stale_after_s - self.heartbeat_s

    def _beat(self) -> None:
        failed: BaseException | None = None  # the last renewal error since the last success
        while not self._stop.wait(self.heartbeat_s):
            # each renewal runs in a thread of its own, so a storage call that hangs (or retries
            # with backoff) cannot carry this run past the end of its lease
            outcome: list[BaseException | None] = []
            attempt = threading.Thread(
                target=self._renew, args=(outcome,), name="ppoflow-lock-renewal", daemon=True
            )
            attempt.start()
            attempt.join(max(0.0, self._lease_end() - time.time()))
            if outcome and outcome[0] is None:
                failed = None
                continue
            now = time.time()
            silent = now - self._renewed_at
            if outcome:
                failed = outcome[0]
                if now + self.heartbeat_s < self._lease_end():  # one more try fits
                    self.log(
                        f"{self.what} heartbeat failed ({silent:.0f} s since the last renewal): {failed}"
                    )
                    continue
            hung = "" if outcome else "; the last renewal got no answer before the lease ended"
            exc = failed or TimeoutError(f"no answer from the storage for {silent:.0f} s")
            self.lost_reason = (
                f"this run could not renew the {self.what} {self.url} for {silent:.0f} s "
                f"(last error: {type(exc).__name__}: {exc}{hung}); after {self.stale_after_s:.0f} s "
                "another run may take it over, so this run stopped writing and committed nothing more"
            )
            self.lost = True
            self._stop.set()
            self.log(self.lost_reason)

    def _renew(self, outcome: list[BaseException | None]) -> None:
        try:
            self.heartbeat()
        except Exception as exc:  # noqa: BLE001 - storage hiccup: _beat decides whether to try again
            outcome.append(exc)
        else:
            outcome.append(None)

    def heartbeat(self) -> None:
        """Refresh ``heartbeat_at``; mark the lock lost if someone else owns it now."""
        owner, version = self._read()
        ours = owner is not None and version is not None and owner.get("token") == self.token
        content = self._content(self._acquired_at)
        if ours and self._storage().replace(self.url, content, version or "") is None:
            again, _ = self._read()  # a refused write, or a storage error: only the owner tells
            if again is not None and again.get("token") == self.token:
                raise OSError(f"the storage refused the write of {self.url}")
            ours = False
        if not ours:
            self.lost = True
            self._stop.set()
            self.log(
                f"{self.what} {self.url} was taken over by run "
                f"{(owner or {}).get('run_id')}; this run stops before its next commit"
            )
        else:
            self._renewed_at = time.time()

    def check(self) -> None:
        """Raise :class:`ExperimentLocked` if the lock was lost (call before writing or committing),
        :class:`LeaseExpired` if it could not be renewed in time."""
        if self.lost_reason is not None:
            raise LeaseExpired(self.lost_reason)
        if self.lost or not self._held:
            raise ExperimentLocked(
                f"this run no longer holds the {self.what} {self.url}; "
                f"another run took the experiment over, so nothing is committed"
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still this run's. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not self._held:
            return
        self._held = False
        owner, version = self._read()
        if owner is not None and version is not None and owner.get("token") == self.token:
            self._storage().delete(self.url, version)  # not ours any more: left alone

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class ExperimentLock(Lease):
    """The lock on one experiment (the module docstring): the lease on ``lock.json``."""

    what = "experiment lock"
