"""Held-out score against wall time, for runs compared side by side (synchronous and asynchronous
training of the same example, say): which run reaches the first run's final score, and how soon.

    python benchmarks/score_vs_time.py LABEL=EXPERIMENT[@START_UNIX_S] ... [--plot FILE.png]

EXPERIMENT is an experiment's directory or URL, or its YAML config. A run's clock starts at
START_UNIX_S when given (the moment its ``ppoflow run`` command started: cold starts included),
else at its first iteration's start. Every evaluated iteration gives one point: the seconds from
the start to that iteration's commit, and its ``val/score``; the evaluation before training
(iteration 0) is the point at 0 s. The first run is the reference: for each other run the summary
says when its held-out score first reached the reference's final score, and the ratio of the
reference's time to that. Each run's start (to its first commit: the workers' start, the
evaluation before training, the first, cold iteration) is printed apart from the time after it, so
that a run that paid a cold compile the other found warm is not read as slower training. Writes
``$OUT/score_vs_time.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os


def curve(experiment: str, start: float | None) -> tuple[list[tuple[int, float, float]], dict[int, float]]:
    """``[(iteration, seconds from the start to its commit, val/score)]`` of one experiment, and the
    seconds from the start to each committed iteration's commit."""
    from ppoflow.cli.commands import experiment_config
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
    from ppoflow.infra.experiment.metrics import headline

    paths = ExperimentPaths.of(experiment_config(experiment))
    manifest = read_manifest(paths)
    if manifest is None:
        raise SystemExit(f"{experiment}: no experiment at {paths.root}")
    val = headline("val")
    scores = {int(r["iteration"]): float(val.value(r)) for r in manifest.trend if val.key_in(r)}
    commits: dict[int, float] = {}
    for n in range(1, int(manifest.iteration) + 1):
        url = paths.file(n, "metrics.json")
        if storage.exists(url):
            m = storage.read_json(url)
            if n == 1 and start is None:
                start = float(m["time/started_unix_s"])
            commits[n] = float(m["time/committed_unix_s"])
    if not commits or start is None:
        raise SystemExit(f"no committed iteration with metrics in {paths.root}")
    points = [
        (n, 0.0 if n == 0 else commits[n] - start, s)
        for n, s in sorted(scores.items())
        if n == 0 or n in commits
    ]
    return points, {n: t - start for n, t in commits.items()}


def reached(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    return next(((n, t) for n, t, s in points if n > 0 and s >= target), None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=EXPERIMENT[@START_UNIX_S]")
    p.add_argument("--plot", help="write both curves to this PNG")
    args = p.parse_args(argv)

    runs = []
    for spec in args.runs:
        label, sep, rest = spec.partition("=")
        if not sep or not rest:
            raise SystemExit(f"{spec!r}: give each run as LABEL=EXPERIMENT[@START_UNIX_S]")
        where, at, start = rest.rpartition("@") if "@" in rest else (rest, "", "")
        points, commits = curve(where, float(start) if at else None)
        first, last = min(commits), max(commits)
        total, warm = commits[last], commits[last] - commits[first]
        runs.append(
            {
                "label": label,
                "experiment": where,
                "points": points,
                "wall_s": total,
                "iterations": last,
                "first_commit_s": commits[first],
                "after_first_commit_s": warm,
            }
        )
        print(f"{label}: {len(points)} evaluations, last commit at {total:.1f} s")
        for n, t, s in points:
            print(f"  iteration {n:>4} | {t:8.1f} s | val {s:.3f}")
        after = f"{warm:.1f} s from it to iteration {last}'s"
        if last > first:
            after += f" ({warm / (last - first):.2f} s an iteration)"
        print(f"  start: iteration {first}'s commit at {commits[first]:.1f} s; {after}")

    ref = runs[0]
    n_ref, t_ref, s_ref = ref["points"][-1]
    print(f"reference {ref['label']}: val {s_ref:.3f} at iteration {n_ref}, {t_ref:.1f} s")
    for run in runs[1:]:
        hit = reached(run["points"], s_ref)
        run["reached"] = hit
        if hit is None:
            best = max(s for n, _, s in run["points"] if n > 0) if len(run["points"]) > 1 else float("nan")
            print(f"{run['label']}: never reached {s_ref:.3f} (best {best:.3f})")
        else:
            print(
                f"{run['label']}: reached {s_ref:.3f} at iteration {hit[0]}, {hit[1]:.1f} s "
                f"({t_ref / hit[1]:.2f}x sooner than {ref['label']})"
            )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            ax.plot(
                [t for _, t, _ in run["points"]], [s for _, _, s in run["points"]], "o-", label=run["label"]
            )
        ax.set_xlabel("seconds from the start of the run")
        ax.set_ylabel("held-out val/score")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "score_vs_time.json"), "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
