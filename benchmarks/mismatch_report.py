"""Sampler vs trainer in numbers: each iteration's ``mismatch/*`` and ``correction/*`` metrics, and
two runs side by side.

Used by ``benchmarks/iteration.py`` (the mismatch lines of its table, and its ``--compare``), and on
its own for experiments run with ``ppoflow run`` (e.g. the SmolLM2 example with and without a
correction): it reads each experiment's ``iterations/*/metrics.json`` and prints the per-iteration
table of each, then the experiments side by side (means over the iterations; the held-out score's
first and last values).

    python benchmarks/mismatch_report.py runs/smollm2/experiments/add2-ppo-gpu \\
        runs/smollm2/experiments/add2-tis [--skip-first 1]

The metrics are defined in ``ppoflow.algos.mismatch`` and ``ppoflow.algos.correction``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

#: (column, metric key, format) of the per-iteration table.
COLUMNS = (
    ("tok_mult_err", "mismatch/token_mult_prob_error", "{:.5f}"),
    ("kl_k1", "mismatch/kl_k1", "{:.2e}"),
    ("kl_k3", "mismatch/kl_k3", "{:.2e}"),
    ("mean|d|", "mismatch/abs_log_ratio_mean", "{:.2e}"),
    ("max|d|", "mismatch/abs_log_ratio_max", "{:.2e}"),
    ("tok_out", "mismatch/token_ratio_outside", "{:.4f}"),
    ("seq_out", "mismatch/seq_ratio_outside", "{:.4f}"),
    ("geo_out", "mismatch/geo_ratio_outside", "{:.4f}"),
    ("ppl_ratio", "mismatch/ppl_ratio", "{:.5f}"),
    ("masked", "correction/masked_token_share", "{:.4f}"),
    ("w_mean", "correction/weight_mean", "{:.4f}"),
    ("capped", "correction/capped_token_share", "{:.4f}"),
)
#: (row, metric key or summary key, format) of the side-by-side comparison.
COMPARED = (
    ("seconds per iteration (between commits)", "iteration_between_commits_s", "{:.3f}"),
    ("generate task s", "timing_s/generate", "{:.3f}"),
    ("  generation s", "rollout/generate_s", "{:.3f}"),
    ("  old log-prob s", "perf/old_log_prob_s", "{:.3f}"),
    ("update_actor s", "timing_s/update_actor", "{:.3f}"),
    ("score (train batch)", "critic/score/mean", "{:.4f}"),
    *((f"{name}", key, fmt) for name, key, fmt in COLUMNS),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if not isinstance(value, (int, float)) or value != value else fmt.format(value)


def mismatch_lines(rows: list[dict]) -> list[str]:
    """The per-iteration mismatch table of ``rows`` (metrics.json records), or nothing when no row
    measured it (the engine's log-probs off, or ``behaviour: sampler``)."""
    if not any(key in r for r in rows for _, key, _ in COLUMNS):
        return []
    cols = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    lines = ["sampler vs trainer per iteration (ppoflow.algos.mismatch / correction):"]
    lines.append(f"{'iter':>6}" + "".join(f"{name:>14}" for name, _, _ in cols))
    for r in rows:
        lines.append(f"{r.get('iteration', '?'):>6}" + "".join(f"{_cell(r, k, f):>14}" for _, k, f in cols))
    return lines


def mean_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else float("nan")


def side_by_side(names: list[str], runs: list[dict]) -> list[str]:
    """``runs``: per run a flat dict of means (metric keys, summary keys); rows present in one at least."""
    width = max(16, *(len(n) + 2 for n in names))
    lines = [f"{'':<42}" + "".join(f"{n:>{width}}" for n in names)]
    for label, key, fmt in COMPARED:
        if all(run.get(key) is None or run.get(key) != run.get(key) for run in runs):
            continue
        lines.append(f"{label:<42}" + "".join(f"{_cell(run, key, fmt):>{width}}" for run in runs))
    for run_key in ("val_first", "val_last"):
        if any(run_key in run for run in runs):
            label = "held-out score, " + ("first" if run_key == "val_first" else "last") + " evaluated"
            lines.append(
                f"{label:<42}" + "".join(f"{_cell(run, run_key, '{:.4f}'):>{width}}" for run in runs)
            )
    return lines


def run_means(rows: list[dict], summary: dict | None = None) -> dict:
    """The means over ``rows`` of every compared metric, the summary's own figures, the held-out
    score's first and last values."""
    out: dict = {key: mean_of(rows, key) for _, key, _ in COMPARED}
    out.update({k: v for k, v in (summary or {}).items() if isinstance(v, (int, float))})
    vals = [r["val/score"] for r in rows if isinstance(r.get("val/score"), (int, float))]
    if vals:
        out["val_first"], out["val_last"] = vals[0], vals[-1]
    return out


#: ``iteration.py --compare``: the two variants, (name, flag values) each.
VARIANTS: dict[str, tuple[tuple[str, dict], tuple[str, dict]]] = {
    "log-probs": (
        ("no engine log-probs", {"rollout_log_probs": False}),
        ("engine log-probs", {"rollout_log_probs": True}),
    ),
    "behaviour": (
        (
            "behaviour trainer",
            {"behaviour": "trainer", "tis": "none", "mis": "none", "rollout_log_probs": True},
        ),
        (
            "behaviour sampler",
            {"behaviour": "sampler", "tis": "none", "mis": "none", "rollout_log_probs": True},
        ),
    ),
    "trainer-dtype": (
        ("bf16 trainer", {"trainer_dtype": "bf16"}),
        ("fp32 trainer", {"trainer_dtype": "fp32"}),
    ),
    "correction": (("no correction", {"tis": "none", "mis": "none"}), ("corrected", {})),
}


def compare_runs(args, work: str, run_once: Callable) -> tuple[str, dict]:
    """Run ``run_once`` for both variants of ``args.compare``; the two tables and the comparison."""
    first, second = VARIANTS[args.compare]
    if args.compare == "correction" and args.tis == "none" and args.mis == "none":
        second = ("corrected", {"tis": "token"})  # nothing named: TIS per token, the TIS paper's cap
    if args.compare == "correction":
        rc = {k: v for k, v in vars(args).items() if k in ("tis", "mis")} | second[1]
        second = (f"tis {rc['tis']}, mis {rc['mis']}", second[1])
    texts, runs, names = [], [], []
    for name, flags in (first, second):
        variant = argparse.Namespace(**{**vars(args), **flags, "compare": None})
        text, run, rows = run_once(variant, os.path.join(work, name.replace(" ", "-").replace(",", "")))
        print(text, flush=True)
        texts.append(f"== {name} ==\n{text}")
        runs.append(run_means(rows[1:], run))  # the warm iterations
        names.append(name)
    table = "\n".join(
        [f"--compare {args.compare}: mean over the warm iterations", *side_by_side(names, runs)]
    )
    print("\n" + table)
    return "\n\n".join([*texts, table]), {"compare": args.compare, **dict(zip(names, runs))}


def read_rows(url: str) -> list[dict]:
    """The metrics.json of every iteration of the experiment at ``url``, in order."""
    from ppoflow.infra.data import storage

    base = storage.join(url, "iterations")
    names = sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in storage.listdir(base))
    rows = []
    for name in names:
        path = storage.join(base, name, "metrics.json")
        if name.isdigit() and storage.exists(path):
            rows.append(storage.read_json(path))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiments", nargs="+", help="experiment URLs/paths (storage.root/experiment)")
    p.add_argument("--skip-first", type=int, default=0, help="leave the first N iterations out of the means")
    args = p.parse_args(argv)
    names, runs = [], []
    for url in args.experiments:
        rows = read_rows(url)
        if not rows:
            print(f"{url}: no committed iteration", file=sys.stderr)
            return 1
        print(f"\n{url}: {len(rows)} iterations")
        print("\n".join(mismatch_lines(rows)) or "  (no mismatch metrics: the engine's log-probs were off)")
        names.append(os.path.basename(url.rstrip("/")))
        runs.append(run_means(rows[args.skip_first :]))
    print("\n" + "\n".join(side_by_side(names, runs)))
    print("summary: " + json.dumps(dict(zip(names, runs))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
