"""Training curves of an experiment as one PNG: reward, KL, response length, value loss.

    from ppoflow.infra.experiment.plots import plot_metrics
    history = [read_json(url) for url in metrics_urls]         # one metrics.json per iteration
    png_url = plot_metrics(history, "runs/demo/metrics.png")   # any fsspec URL; written atomically

Each panel plots every one of its metric keys that appears in the history (iterations that lack a
key are skipped, so old and new metric names can mix); a panel with no data says so instead of
failing. The x axis is each record's ``iteration`` (1, 2, ... when absent). Rendering uses
matplotlib's Agg canvas directly (no pyplot, no global state), so it is safe in threads and in
processes without a display.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import HEADLINES

__all__ = ["panels", "plot_metrics", "series"]


def panels() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(panel title, y label, [(metric key, legend label), ...]) from the headline metrics spec."""
    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for h in HEADLINES:
        if h.panel is not None:
            out.setdefault(h.panel, []).extend(h.series)
    return [(title, ylabel, series) for (title, ylabel), series in out.items()]


def _number(value: Any) -> float | None:
    """A finite float, or None for missing, non-numeric and NaN/inf values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series(history: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """``(iterations, values)`` of one metric over the history, skipping records without it."""
    xs, ys = [], []
    for i, record in enumerate(history):
        y = _number(record.get(key))
        if y is None:
            continue
        x = _number(record.get("iteration"))
        xs.append(x if x is not None else float(i + 1))
        ys.append(y)
    return xs, ys


def _render(history: Sequence[dict], title: str | None) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    for ax, (panel, ylabel, keys) in zip(axes, panels()):
        drawn = 0
        for key, label in keys:
            xs, ys = series(history, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn += 1
        ax.set_title(panel)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    if title:
        fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_metrics(
    history: list[dict], out_url: str, *, title: str | None = None, storage_options: dict | None = None
) -> str:
    """Plot reward, KL, response length and value loss over iterations; returns ``out_url``.

    Args:
        history: one metrics dict per iteration, oldest first (the contents of each
            ``iterations/{n:06d}/metrics.json``); an ``iteration`` key sets the x value.
        out_url: where the PNG goes: a path or any fsspec URL; published atomically.
        title: optional figure title (e.g. the experiment name).
        storage_options: passed to fsspec for ``out_url``.
    """
    if not isinstance(history, (list, tuple)) or not all(isinstance(r, dict) for r in history):
        raise TypeError("history must be a list of metrics dicts (one per iteration)")
    png = _render(history, title)
    storage.write_bytes_atomic(out_url, png, storage_options=storage_options)
    return out_url
