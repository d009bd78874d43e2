"""The trainer's hold on the queue: the stop marker, the queue made consistent with the committed
state, retention after a commit, and the queue as ``ppoflow status`` shows it.

- ``stop.json``: the trainer writes it at the end of its run (or a person, to stop external
  producers); a producer that finds it stops at the next batch boundary. A trainer's run removes it
  when it starts.
- :func:`reconcile`: when a trainer run starts from manifest m, what the queue holds beyond the
  committed state goes: policy versions > m (published by updates that never committed, or
  undone by a rollback) and every batch that any of them sampled, and batches <= m (consumed).
- :func:`retain`: after commit n, batches <= n and old policy versions go, and the pointer names
  the newest complete version.
"""

from __future__ import annotations

import time
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.queue.batches import claim_holder, drop_batches, part_versions, read_record
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import KEEP_VERSIONS, PolicyVersions

__all__ = ["request_stop", "stop_requested", "clear_stop", "reconcile", "retain", "queue_status"]


def request_stop(paths: QueuePaths, reason: str, after: int | None = None) -> None:
    """Tell the producers to stop (``after``: the last iteration the trainer will consume)."""
    storage.write_json_atomic(paths.stop, {"reason": reason, "after": after, "at": time.time()})


def stop_requested(paths: QueuePaths) -> dict[str, Any] | None:
    """The stop marker, or None."""
    try:
        return storage.read_json(paths.stop)
    except FileNotFoundError:
        return None


def clear_stop(paths: QueuePaths) -> None:
    if storage.exists(paths.stop):
        storage.rm(paths.stop)


def _newest_version(paths: QueuePaths, k: int, record: dict[str, Any] | None) -> int | None:
    if record is not None:
        return int(record["versions"][1]) if record.get("versions") else None
    return part_versions(paths, k)


def reconcile(paths: QueuePaths, committed: int) -> dict[str, list[int]]:
    """Make the queue agree with manifest ``committed`` (module docstring); what was removed."""
    versions = PolicyVersions(paths)
    stale = [v for v in paths.versions() if v > committed]
    if stale:
        versions.reset(committed if committed in paths.versions() else None)
    else:
        versions.settle()

    def keep(k: int, record: dict[str, Any] | None) -> bool:
        if k <= committed:
            return False
        newest = _newest_version(paths, k, record)
        return newest is None or newest <= committed

    dropped = drop_batches(paths, keep)
    clear_stop(paths)
    return {"versions": stale, "batches": dropped}


def retain(paths: QueuePaths, committed: int, keep_versions: int = KEEP_VERSIONS) -> list[str]:
    """After commit ``committed``: delete the batches it and earlier commits consumed, and the policy
    versions more than ``keep_versions`` behind the newest. Returns what went (references)."""
    gone = [f"batches/{k:06d}" for k in drop_batches(paths, lambda k, _: k > committed)]
    versions = PolicyVersions(paths)
    versions.settle()
    gone += [f"policy/v{v:06d}" for v in versions.retain(keep_versions)]
    return gone


def queue_status(paths: QueuePaths, committed: int | None) -> dict[str, Any]:
    """What the queue holds: the newest policy version and each batch on storage, ``waiting``
    (complete, not consumed), ``in flight`` (claimed, with its parts' rows) or ``consumed`` (<= the
    committed iteration, not yet removed), with the staleness its record gives."""
    latest = PolicyVersions(paths).latest()
    rows = []
    for k in paths.batch_numbers():
        record = read_record(paths, k)
        if committed is not None and k <= committed:
            state = "consumed"
        elif record is not None:
            state = "waiting"
        else:
            state = "in flight"
        entry: dict[str, Any] = {"batch": k, "state": state}
        if record is not None:
            entry.update(
                rows=record.get("rows"),
                versions=record.get("versions"),
                staleness_max=(k - 1 - record["versions"][0]) if record.get("versions") else None,
            )
        else:
            holder = claim_holder(paths, k) or {}
            entry.update(parts=len(paths.parts(k)), producer=holder.get("run_id"), host=holder.get("host"))
        rows.append(entry)
    return {
        "latest_version": None if latest is None else latest.version,
        "batches": rows,
        "stopped": stop_requested(paths) is not None,
    }
