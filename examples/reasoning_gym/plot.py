"""Held-out curves of an experiment, one line per data source: every evaluation it committed
(``iterations/<n>/eval/val/metrics.json``), greedy score against iteration, written as a PNG and
printed as a table.

    python examples/reasoning_gym/plot.py examples/reasoning_gym/gpu.yaml docs/bench/reasoning_gym_h200.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ppoflow.infra.config import load_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest


def curves(config: str) -> dict[str, list[tuple[int, float]]]:
    """``{data_source or "all": [(iteration, mean greedy score), ...]}``."""
    paths = ExperimentPaths.of(load_config(config))
    manifest = read_manifest(paths)
    if manifest is None:
        raise SystemExit(f"{paths.root}: no committed iteration")
    out: dict[str, list[tuple[int, float]]] = {}
    for n in range(manifest.iteration + 1):
        url = paths.file(n, "eval/val/metrics.json")
        if not storage.exists(url):
            continue
        metrics = json.loads(storage.read_bytes(url))
        out.setdefault("all", []).append((n, metrics["val/score"]))
        for key, value in metrics.items():
            if key.startswith("val/") and key.endswith("/score/mean@1") and key.count("/") > 3:
                out.setdefault(key[4 : -len("/score/mean@1")], []).append((n, value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("png")
    args = ap.parse_args()
    data = curves(args.config)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in sorted(data.items()):
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label=name, linewidth=2.5 if name == "all" else 1.2)
        print(f"{name:40s} " + "  ".join(f"{n}:{v:.3f}" for n, v in points))
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out score (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"-> {args.png}")


if __name__ == "__main__":
    main()
