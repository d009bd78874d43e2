"""TensorBoard event files of the metrics: readable by TensorBoard, and appended to, never rewritten."""

from __future__ import annotations

import os

import pytest

from tests.support.experiments import metric_history


def test_tensorboard_events_are_readable_and_append_only(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ppoflow.infra.experiment.tensorboard import event_bytes, write_events

    history = metric_history(6)
    assert event_bytes(history).startswith(event_bytes(history[:3]))  # a longer history appends
    url = write_events(history, str(tmp_path / "tb"))
    assert os.path.basename(url).startswith("events.out.tfevents.")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "critic/score/mean" in acc.Tags()["scalars"] and "note" not in acc.Tags()["scalars"]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("critic/vf_loss")][:2] == [(1, 1.0), (2, 0.5)]
