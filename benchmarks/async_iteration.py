"""Asynchronous training beside the synchronous flow, one shape, one device; prints one table.

The shape, the model and the flags are ``benchmarks/iteration.py``'s (the same parser and config):
the benchmark builds the model and prompts once, then runs the ``ppo`` flow for ``1 + K``
iterations per mode, each a fresh experiment: ``sync`` (the synchronous flow) and asynchronous
training at each ``--staleness`` (s = 0, 1, 2 by default), the producer started by the trainer on
the same device (one GPU: the engine samples while the trainer updates). Snapshots every
``--snapshot-every`` iterations (10, the default) are part of what is measured.

    python benchmarks/async_iteration.py --preset tiny --device cpu --ranks 1 --iters 4    # CPU
    python benchmarks/async_iteration.py --preset qwen2.5-0.5b --device cuda --ranks 1 \\
        --prompts 256 --prompt-len 512 --response-len 256 --micro-batch 32 \\
        --log-prob-micro-batch 32 --dynamic-bsz --compile --iters 5 --snapshot-every 5   # one H200, ~8 min
    ... --staleness sync --iters 20 --snapshot-every 10     # 20+ iterations: one mode per command
    ... --staleness sync,2 --iters 20 --metrics-only        # or several, each run's checkpoints,
                                    # rollouts and queue removed once measured (a 64 GB disk)

Per mode: seconds per committed iteration (the interval between consecutive commits after the
first, cold one: the mean over every iteration, snapshot iterations included, and the median),
the trainer's idle share (``async/wait_s`` over the interval: waiting for the batch), the
producer's busy share (``async/sample_s``: sampling, the weight pushes included), its push
seconds, and the staleness (mean and max over each batch's tokens). ``OUT`` set: the JSON goes
to ``$OUT/async_iteration.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from iteration import build_model, build_prompts, experiment_config, parse_args  # beside this script

ROWS = (
    ("seconds per iteration (mean)", "mean_s", "{:.2f}"),
    ("seconds per iteration (median)", "median_s", "{:.2f}"),
    ("trainer idle share", "idle_share", "{:.0%}"),
    ("producer busy share", "producer_share", "{:.0%}"),
    ("producer push s / batch", "push_s", "{:.3f}"),
    ("trainer publish s / iteration", "publish_s", "{:.3f}"),
    ("staleness mean", "staleness_mean", "{:.2f}"),
    ("staleness max", "staleness_max", "{:.0f}"),
    ("sequences across an update", "mixed", "{:.0f}"),
)


def _split(argv: list[str]) -> tuple[list[str], list[str], dict, bool]:
    """This benchmark's own flags out of ``argv``; the rest is iteration.py's."""
    own = {"--staleness": "sync,0,1,2", "--in-flight": "continue", "--chunk-tokens": "64"}
    rest, i, metrics_only = [], 0, False
    while i < len(argv):
        if argv[i] == "--metrics-only":
            metrics_only = True
            i += 1
        elif argv[i] in own:
            own[argv[i]] = argv[i + 1]
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    modes = own["--staleness"].split(",")
    extra = {"in_flight": own["--in-flight"], "chunk_tokens": int(own["--chunk-tokens"])}
    return modes, rest, extra, metrics_only


def summarize(rows: list[dict]) -> dict:
    """The figures of one mode from its iterations' metrics (the first, cold one left out)."""
    stamps = [r["time/committed_unix_s"] for r in rows]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    warm = rows[1:]

    def mean(key: str) -> float:
        vals = [r[key] for r in warm if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    interval = sum(gaps) / len(gaps)
    return {
        "mean_s": interval,
        "median_s": statistics.median(gaps),
        "idle_share": mean("async/wait_s") / interval,
        "producer_share": mean("async/sample_s") / interval,
        "push_s": mean("async/push_s"),
        "publish_s": mean("async/publish_s"),
        "staleness_mean": mean("async/staleness_mean"),
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in warm), default=0.0),
        "mixed": sum(r.get("async/mixed_version_sequences", 0.0) for r in warm),
        "iterations": len(gaps),
    }


def keep_metrics_only(experiment: str) -> None:
    """Remove all of a (local) experiment but its ``iterations/*/metrics.json``: checkpoints,
    snapshots, rollouts and the queue of a 0.5B run are tens of GB, and several modes in a row
    would fill a small disk."""
    for top, dirs, files in os.walk(experiment, topdown=False):
        keep = os.path.basename(os.path.dirname(top)) == "iterations"
        for name in files:
            if not (keep and name == "metrics.json"):
                os.remove(os.path.join(top, name))
        for name in dirs:
            path = os.path.join(top, name)
            if not os.listdir(path):
                os.rmdir(path)


def run_mode(args, mode: str, extra: dict, model_dir: str, data_url: str, work: str) -> dict:
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.config import parse_config

    config = experiment_config(args, model_dir, data_url, os.path.join(work, f"runs-{mode}"))
    config["checkpoint"]["snapshot_every"] = args.snapshot_every or 10
    if mode != "sync":
        config["asynchronous"] = {"enable": True, "max_staleness": int(mode), **extra}
    cfg = parse_config(config)
    t0 = time.perf_counter()
    ppo(cfg, iterations=1 + args.iters)
    print(f"{mode}: {time.perf_counter() - t0:.1f} s for {1 + args.iters} iterations", flush=True)
    rows = []
    for n in range(1, args.iters + 2):
        with open(os.path.join(cfg.storage.experiment_url, "iterations", f"{n:06d}", "metrics.json")) as f:
            rows.append(json.load(f))
    if args.metrics_only:
        keep_metrics_only(cfg.storage.experiment_url)
    return summarize(rows)


def table(results: dict[str, dict]) -> str:
    names = list(results)
    lines = [f"{'':<34}" + "".join(f"{('s=' + m if m != 'sync' else m):>10}" for m in names)]
    for label, key, fmt in ROWS:
        cells = []
        for m in names:
            v = results[m].get(key)
            cells.append("-" if v is None or v != v else fmt.format(v))  # nan: not measured in the mode
        lines.append(f"{label:<34}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    modes, rest, extra, metrics_only = _split(list(sys.argv[1:] if argv is None else argv))
    args = parse_args(rest)
    args.metrics_only = metrics_only
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = args.storage or tempfile.mkdtemp(prefix="ppoflow-async-bench-")
    os.makedirs(work, exist_ok=True)  # PREFECT_HOME below lives in it: a missing --storage dir is made
    os.environ.setdefault("PREFECT_HOME", os.path.join(work, "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from ppoflow.cli.local_api import local_server  # the producer's process reports to the same API
    from ppoflow.infra.runtime.signals import install_stop_handlers

    install_stop_handlers()
    server = local_server()
    if server is not None:
        server.start_in_background()
        server.wait()
    model_dir, data_url = os.path.join(work, "model"), os.path.join(work, "prompts.parquet")
    build_model(model_dir, args.preset, args.prompt_len + args.response_len + 8, args.mean_response_len)
    build_prompts(data_url, args.prompts * (args.iters + 4), args.prompt_len)
    results = {}
    try:
        for mode in modes:
            results[mode] = run_mode(args, mode, extra, model_dir, data_url, work)
            print(table(results), flush=True)  # so far: what a cut-short run has measured
    finally:
        if server is not None:
            server.stop()
    text = table(results)
    print(text)
    print("summary: " + json.dumps(results))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "async_iteration.json"), "w") as f:
            json.dump({"results": results, "args": vars(args), "modes": modes, **extra}, f, indent=1)
    if not args.storage and not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
