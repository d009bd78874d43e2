"""TensorBoard event files of an experiment's per-iteration metrics (optional dependency).

    from ppoflow.infra.experiment.tensorboard import write_events
    write_events(history, "runs/demo/tensorboard")    # then: tensorboard --logdir runs/demo/tensorboard

Stateless and idempotent: every call writes the *whole* history as one event file with a fixed
name, published atomically, so each flow run can simply rewrite it after an iteration. Event wall
times come from the records (``timestamp``, seconds since the epoch) or, when absent, from the
iteration number, so a longer history rewrites the same bytes followed by the new events: a running
TensorBoard, which reads event files incrementally, sees only the appended iterations.

Every finite numeric metric becomes a scalar tagged with its metric name (``critic/score/mean``,
``timing_s/generate``, ...), step = the record's ``iteration``. Needs the ``tensorboard`` package
(``pip install 'ppoflow[tensorboard]'``); only its protobuf definitions are used, not TensorFlow.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import finite_scalars

__all__ = ["EVENT_FILE_NAME", "event_bytes", "write_events"]

EVENT_FILE_NAME = "events.out.tfevents.0000000000.ppoflow"


def _imports():
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "TensorBoard event files need the tensorboard package: pip install 'ppoflow[tensorboard]'"
        ) from err
    return event_pb2, summary_pb2, RecordWriter


def _scalars(record: dict[str, Any]) -> list[tuple[str, float]]:
    return sorted(finite_scalars(record).items())


def event_bytes(history: Sequence[dict[str, Any]]) -> bytes:
    """The TFRecord-framed event stream (file version header + one event per iteration)."""
    event_pb2, summary_pb2, RecordWriter = _imports()
    buf = io.BytesIO()
    writer = RecordWriter(buf)
    first_time = 0.0
    if history and isinstance(history[0].get("timestamp"), (int, float)):
        first_time = float(history[0]["timestamp"])
    writer.write(event_pb2.Event(wall_time=first_time, file_version="brain.Event:2").SerializeToString())
    for i, record in enumerate(history):
        step = record.get("iteration", i + 1)
        step = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else i + 1
        stamp = record.get("timestamp")
        wall_time = (
            float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) else float(step)
        )
        values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in _scalars(record)]
        event = event_pb2.Event(wall_time=wall_time, step=step, summary=summary_pb2.Summary(value=values))
        writer.write(event.SerializeToString())
    return buf.getvalue()


def write_events(
    history: Sequence[dict[str, Any]], log_dir_url: str, storage_options: dict | None = None
) -> str:
    """Write the event file for ``history`` (one metrics dict per iteration, oldest first) under
    ``log_dir_url`` (any fsspec URL); returns the file's URL."""
    url = storage.join(log_dir_url, EVENT_FILE_NAME)
    storage.write_bytes_atomic(url, event_bytes(history), storage_options=storage_options)
    return url
