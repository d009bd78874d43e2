"""The pace of a finished (or stopped) run, read from what it committed: one line per iteration.

    python benchmarks/commit_intervals.py EXPERIMENT [--from N]

EXPERIMENT is an experiment's directory or URL, or its YAML config. For every committed
iteration the table gives the seconds since the previous commit (the steady-state pace: iterations
overlap, so this is the figure that adds up to a run's wall time), one iteration's start to its
commit, whether it wrote model and optimizer state (a snapshot) or committed its update's record
for replay, how long its commit waited for checkpoint writes, the largest task times, and the
held-out ``val/score`` where an evaluation ran. The summary splits the intervals by iterations that
wrote a snapshot and those that did not, and gives the mean over all of them, which is what a run
of that many iterations pays per iteration. The first iteration of each run pays the cold starts
(worker groups, engine, compilation) inside its tasks: an iteration whose tasks took more than
three times the median is marked ``(cold)`` and left out of the summary. Writes
``$OUT/commit_intervals.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

TASKS = ("generate", "values", "ref_log_prob", "advantage", "update_actor", "update_critic", "evaluate")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument("--from", dest="first", type=int, default=1, help="first iteration listed")
    args = p.parse_args(argv)

    from ppoflow.cli.commands import experiment_config
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths

    paths = ExperimentPaths.of(experiment_config(args.experiment))
    last = int(storage.read_json(paths.manifest)["iteration"])
    rows = []
    for n in range(args.first, last + 1):
        url = paths.file(n, "metrics.json")
        if storage.exists(url):
            rows.append(storage.read_json(url))
    if not rows:
        raise SystemExit(f"no committed iteration with metrics in {paths.root}")

    header = f"{'iter':>5} {'interval':>9} {'latency':>8} {'state':>8} {'ckpt wait':>9}  tasks (s)"
    print(header)
    out = []
    previous_commit = None
    task_s = [sum(m.get(f"timing_s/{t}", 0.0) for t in TASKS) for m in rows]
    typical = statistics.median(task_s)
    for m, spent in zip(rows, task_s):
        n = int(m["iteration"])
        started, committed = m.get("time/started_unix_s"), m.get("time/committed_unix_s")
        interval = committed - previous_commit if previous_commit and committed else None
        cold = spent > 3 * typical
        snapshot = any(k.startswith("perf/checkpoint_bytes_") for k in m)
        tasks = {t: m[f"timing_s/{t}"] for t in TASKS if f"timing_s/{t}" in m}
        row = {
            "iteration": n,
            "interval_s": interval,
            "latency_s": committed - started if started and committed else None,
            "snapshot": snapshot,
            "cold": cold,
            "commit_wait_s": m.get("timing_s/commit_wait_checkpoints"),
            "tasks_s": tasks,
            "val_score": m.get("val/score"),
            "score": m.get("critic/score/mean"),
        }
        out.append(row)
        fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        extra = f"  val {row['val_score']:.3f}" if row["val_score"] is not None else ""
        print(
            f"{n:>5} {fmt(interval):>9} {fmt(row['latency_s']):>8} "
            f"{'snapshot' if snapshot else 'replay':>8} {fmt(row['commit_wait_s']):>9}  "
            + " ".join(f"{t} {v:.2f}" for t, v in tasks.items())
            + (" (cold)" if cold else "")
            + extra
        )
        previous_commit = committed

    warm = [r for r in out if not r["cold"] and r["interval_s"] is not None]
    summary: dict = {"iterations": len(out), "warm": len(warm)}
    for name, subset in (
        ("all", warm),
        ("replay", [r for r in warm if not r["snapshot"]]),
        ("snapshot", [r for r in warm if r["snapshot"]]),
    ):
        if subset:
            iv = [r["interval_s"] for r in subset]
            lat = [r["latency_s"] for r in subset if r["latency_s"] is not None]
            summary[name] = {
                "count": len(subset),
                "interval_mean_s": statistics.fmean(iv),
                "interval_median_s": statistics.median(iv),
                "latency_median_s": statistics.median(lat) if lat else None,
            }
            print(
                f"{name} warm iterations ({len(subset)}): between commits mean {statistics.fmean(iv):.2f} s, "
                f"median {statistics.median(iv):.2f} s; start to commit median "
                + (f"{statistics.median(lat):.2f} s" if lat else "-")
            )
    scores = [(r["iteration"], r["val_score"]) for r in out if r["val_score"] is not None]
    if scores:
        print("held-out val/score: " + ", ".join(f"{n}: {s:.3f}" for n, s in scores))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "commit_intervals.json"), "w") as f:
            json.dump({"rows": out, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
