"""The rollout queue of asynchronous training as ``ppoflow status`` shows it: the newest published
policy version, and each batch on storage waiting, in flight (which producer, how many parts) or
consumed, with its staleness (``ppoflow.infra.queue.control.queue_status``)."""

from __future__ import annotations

from typing import Any

__all__ = ["queue_status_of", "queue_lines", "print_queue"]


def queue_status_of(paths: Any, committed: int) -> dict[str, Any] | None:
    """The queue of the experiment at ``paths`` (None: it has none: synchronous training)."""
    from ppoflow.infra.data import storage
    from ppoflow.infra.queue.control import queue_status
    from ppoflow.infra.queue.layout import QueuePaths

    queue = QueuePaths(paths.root)
    return queue_status(queue, committed) if storage.exists(queue.root) else None


def queue_lines(paths: Any, committed: int) -> list[str]:
    """The lines ``ppoflow status`` prints about the queue (none without one)."""
    status = queue_status_of(paths, committed)
    if status is None:
        return []
    stopped = " (producers told to stop)" if status["stopped"] else ""
    lines = [
        "",
        f"rollout queue ({paths.root}/queue): newest policy version {status['latest_version']}{stopped}",
    ]
    for row in status["batches"] or [{"batch": "-", "state": "empty"}]:
        if row["state"] == "in flight":
            detail = f"{row['parts']} part(s) published, producer {row['producer']} on {row['host']}"
        elif "versions" in row:
            detail = f"{row['rows']} rows, versions {row['versions']}, staleness max {row['staleness_max']}"
        else:
            detail = ""
        lines.append(f"  batch {row['batch']:>6}  {row['state']:<9}  {detail}".rstrip())
    return lines


def print_queue(paths: Any, committed: int) -> None:
    """Print :func:`queue_lines` (nothing without a queue)."""
    for line in queue_lines(paths, committed):
        print(line)
