"""The policy versions the trainer publishes for the producers: ``queue/policy/``.

Version v is the policy after update v (v = 0: the base weights). The trainer writes its weights
(a weights-only DCP checkpoint, completion marker last) to ``policy/v{v:06d}/``; the marker is the
version's commit point. The pointer ``policy/latest.json``
(``{version, ref, published_at}``) names the newest version known complete and only moves forward
(:meth:`PolicyVersions.publish`, replace-if-match: of two writers racing, each retries on the
version it read). :meth:`PolicyVersions.latest` is the newer of the pointer and any complete
version after it (a write that finished since the pointer last moved), so a producer loads a
version the moment its marker lands, and never one whose weights are not complete.

Retention (:meth:`PolicyVersions.retain`): a producer always loads the newest version, so only the
last few are kept (one being loaded while a newer one lands must not vanish under it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.queue.layout import QueuePaths

__all__ = ["PolicyVersions", "Published", "QueueStopped", "KEEP_VERSIONS"]

#: Versions kept behind the newest (a producer loading one when a newer lands still finds it).
KEEP_VERSIONS = 2


class QueueStopped(RuntimeError):
    """A wait on the queue ended because the producer was told to stop."""


@dataclass(frozen=True)
class Published:
    """A published policy version: its number and the URL of its weights."""

    version: int
    url: str


class PolicyVersions:
    """The published policy versions of one experiment's queue (module docstring)."""

    def __init__(self, paths: QueuePaths):
        self.paths = paths
        self._backend = storage.backend_for(paths.latest)

    def pointed(self) -> Published | None:
        """The version ``latest.json`` names, or None."""
        try:
            raw, _ = self._backend.read_versioned(self.paths.latest)
        except FileNotFoundError:
            return None
        record = json.loads(raw)
        return Published(int(record["version"]), self.paths.url(record["ref"]))

    def latest(self) -> Published | None:
        """The newest complete version: the pointer's, or a newer one whose marker landed since
        (None before the first)."""
        pointed = self.pointed()
        floor = -1 if pointed is None else pointed.version
        for v in sorted((v for v in self.paths.versions() if v > floor), reverse=True):
            if is_complete(self.paths.policy(v)):
                return Published(v, self.paths.policy(v))
        return pointed

    def settle(self) -> Published | None:
        """Move the pointer to the newest complete version (for readers of ``latest.json``)."""
        found = self.latest()
        if found is not None:
            self.publish(found.version)
        return found

    def publish(self, version: int) -> bool:
        """Point ``latest.json`` at ``version`` (its weights must be complete). Returns False when the
        pointer already names this version or a newer one (it never moves back)."""
        url = self.paths.policy(version)
        if not is_complete(url):
            raise FileNotFoundError(f"policy version {version} at {url} is not complete: nothing to publish")
        record = json.dumps(
            {"version": version, "ref": self.paths.ref(url), "published_at": time.time()}
        ).encode()
        for _ in range(20):
            try:
                raw, token = self._backend.read_versioned(self.paths.latest)
            except FileNotFoundError:
                if self._backend.create(self.paths.latest, record) is not None:
                    return True
                continue
            if int(json.loads(raw)["version"]) >= version:
                return False
            if self._backend.replace(self.paths.latest, record, token) is not None:
                return True
        raise RuntimeError(f"{self.paths.latest} kept changing while version {version} was published")

    def reset(self, version: int | None) -> None:
        """Point ``latest.json`` back at ``version`` (None: remove it) and delete every newer
        version: what a trainer does when the experiment's committed state is older than the queue
        (a rollback, or updates of an iteration that never committed)."""
        for v in self.paths.versions():
            if version is None or v > version:
                storage.rm(self.paths.policy(v), recursive=True)
        if storage.exists(self.paths.latest):
            storage.rm(self.paths.latest)
        if version is not None and is_complete(self.paths.policy(version)):
            self.publish(version)

    def wait(
        self,
        at_least: int,
        *,
        poll_s: float,
        stopped: Callable[[], bool] = lambda: False,
        timeout_s: float | None = None,
    ) -> Published:
        """The newest version once it is ``>= at_least``; :class:`QueueStopped` when ``stopped()``
        says so first, ``TimeoutError`` after ``timeout_s``."""
        t0 = time.monotonic()
        while True:
            found = self.latest()
            if found is not None and found.version >= at_least:
                return found
            if stopped():
                raise QueueStopped(f"stopped while waiting for policy version {at_least}")
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"no policy version >= {at_least} was published within {timeout_s:.0f} s "
                    f"({self.paths.latest} names {found.version if found else 'none'})"
                )
            time.sleep(poll_s)

    def retain(self, keep: int = KEEP_VERSIONS) -> list[int]:
        """Delete the versions more than ``keep`` behind the newest published one; returns them."""
        newest = self.latest()
        if newest is None:
            return []
        old = [v for v in self.paths.versions() if v < newest.version - keep]
        for v in old:
            storage.rm(self.paths.policy(v), recursive=True)
        return old
