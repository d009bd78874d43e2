"""Training curves as one PNG, on any URL."""

from __future__ import annotations

import os

import pytest

from ppoflow.infra.data import storage
from tests.support.experiments import metric_history

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_metrics_writes_a_png_to_any_url(tmp_path):
    from ppoflow.infra.experiment.plots import plot_metrics, series

    url = plot_metrics(metric_history(), str(tmp_path / "sub" / "m.png"), title="t")
    data = open(url, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not [p for p in os.listdir(tmp_path / "sub") if p != "m.png"]  # no temp file left
    assert plot_metrics([], "memory://plots/empty.png") == "memory://plots/empty.png"  # "no data" panels
    assert storage.read_bytes("memory://plots/empty.png").startswith(PNG_MAGIC)
    assert series([{"a": 1.0}, {"b": 2}, {"a": float("nan")}, {"a": 3, "iteration": 9}], "a") == (
        [1.0, 9.0],
        [1.0, 3.0],
    )
    with pytest.raises(TypeError):
        plot_metrics({"critic/score/mean": 1.0}, str(tmp_path / "x.png"))
