"""How the CPU ranks' OpenMP threads wait, measured on the demo: libgomp's default (spin a while,
then sleep), spinning (``OMP_WAIT_POLICY=ACTIVE``), sleeping (``PASSIVE``, what ppoflow gives CPU
ranks unless the environment says otherwise), and one thread a rank. Prints one table.

The demo (``ppoflow demo``'s task, model and config) is built once; then the ``ppo`` flow runs
``--iterations`` iterations per setting, each a fresh experiment from the same warm-started model
and problems, one after the other in this process. At ``--nprocs 1`` on 2 cores each group's rank
gets both cores' worth of threads, and the actor's and the critic's updates run at once: the
case where a spinning thread holds a core the other group needs.

    python benchmarks/cpu_wait_policy.py --nprocs 1 --iterations 8        # about 12 min on 2 cores
    python benchmarks/cpu_wait_policy.py --nprocs 2 --settings default,PASSIVE

Per setting: the flow run's wall seconds, the seconds before iteration 1 began (the worker
groups' start and the evaluation of iteration 0), the mean and
median seconds per iteration over every iteration (``timing_s/iteration``), the slowest one, and
the held-out score before and after (greedy, the demo's problems): the same in every row, as the
setting changes only how threads wait.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

SETTINGS = {
    # libgomp's own policy (spin a while, then sleep): an empty value reads as unset (libgomp prints
    # one "Invalid value" line per rank), and procs.rank_env keeps a value that is there
    "default": {"OMP_WAIT_POLICY": ""},
    "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1-thread": {"OMP_WAIT_POLICY": "", "PPOFLOW_RANK_THREADS": "1"},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nprocs", type=int, default=1, help="ranks per worker group (resources.nprocs)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument(
        "--settings",
        default="default,ACTIVE,PASSIVE,1-thread",
        help=f"comma-separated: {', '.join(SETTINGS)}",
    )
    p.add_argument(
        "--storage", default=None, help="where the experiments go (default: a temporary directory)"
    )
    args = p.parse_args(argv)
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        p.error(f"unknown setting(s) {unknown}: choose from {', '.join(SETTINGS)}")
    return args


def run_one(root: str, iterations: int, nprocs: int) -> dict:
    """One fresh demo experiment under ``root`` for ``iterations`` iterations; its figures."""
    from ppoflow.demo.experiment import DemoSpec, prepare
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
    from ppoflow.infra.experiment.metrics import headline

    over = {"evaluation.every": iterations, "resources.nprocs": nprocs}
    cfg = prepare(root, DemoSpec(overrides=over), log=lambda *_: None)
    t0, started = time.perf_counter(), time.time()
    assert ppo(cfg, iterations=iterations)["iteration"] == iterations
    wall = time.perf_counter() - t0
    paths = ExperimentPaths.of(cfg)
    per = [
        storage.read_json(paths.file(n, "metrics.json"))["timing_s/iteration"]
        for n in range(1, iterations + 1)
    ]
    first = storage.read_json(paths.file(1, "metrics.json"))
    h = headline("val")
    scores = [h.value(r) for r in read_manifest(paths).trend if h.key_in(r)]
    return {
        "wall_s": wall,
        "init_s": first["time/started_unix_s"] - started,
        "mean_s": statistics.fmean(per),
        "median_s": statistics.median(per),
        "max_s": max(per),
        "score": f"{scores[0]:.2f} -> {scores[-1]:.2f}",
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    work = args.storage or tempfile.mkdtemp(prefix="cpu-wait-policy-")
    os.makedirs(work, exist_ok=True)
    rows: dict[str, dict] = {}
    built = None
    saved = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "PPOFLOW_RANK_THREADS")}
    with prefect_test_harness(server_startup_timeout=180):
        for name in args.settings.split(","):
            root = os.path.join(work, name)
            if built:  # the same warm-started model and problems
                for part in ("models", "data"):
                    shutil.copytree(os.path.join(built, part), os.path.join(root, part))
            os.environ.update(SETTINGS[name])  # the ranks' environment (procs.rank_env keeps it)
            try:
                rows[name] = run_one(root, args.iterations, args.nprocs)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            built = built or root
            print(f"{name}: {rows[name]}", flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nthe demo, resources.nprocs={args.nprocs}, {args.iterations} iterations, {cores} cores")
    print(
        f"{'setting':<10} {'flow run s':>10} {'before 1':>8} {'mean s/it':>9} {'median':>7} {'slowest':>7}  held-out"
    )
    for name, r in rows.items():
        print(
            f"{name:<10} {r['wall_s']:>10.1f} {r['init_s']:>8.1f} {r['mean_s']:>9.2f} {r['median_s']:>7.2f} "
            f"{r['max_s']:>7.2f}  {r['score']}"
        )
    if not args.storage:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
