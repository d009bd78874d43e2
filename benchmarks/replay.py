"""Replay against training: rebuild a written state by replaying its updates, and compare.

    python benchmarks/replay.py EXPERIMENT [--role actor|critic] [--from A] [--to B]

EXPERIMENT is an experiment (its URL or path, or its YAML config) holding complete checkpoints
(snapshots) of ``--role`` at iterations A < B; by default the last two on storage. The benchmark
starts a worker group of the role as a resume does, loads checkpoint A, runs the updates of
iterations A+1..B again on their stored batches (``iterations/<k>/advantages.arrow``, split by
mini-batch blocks as training splits them), saves the result in a scratch directory and compares
every model tensor with checkpoint B, the state training wrote. It prints the seconds per update
replayed and the largest absolute difference per tensor (0 everywhere: bit-identical), and writes
``$OUT/replay_bench.json`` when ``OUT`` is set.

This is how exact a resume between snapshots is on the machine it runs on: on CPU (gloo) the
replay is bit-identical (the test suite checks it); on GPUs it is as exact as the update kernels
are deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument("--role", choices=("actor", "critic"), default="actor")
    p.add_argument("--from", dest="first", type=int, default=None, help="snapshot to replay from")
    p.add_argument("--to", dest="last", type=int, default=None, help="snapshot to compare with")
    args = p.parse_args(argv)

    import torch

    from ppoflow.cli.commands import experiment_config
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths
    from ppoflow.infra.experiment.retention import checkpoint_sizes
    from ppoflow.infra.remote.driver.slots import device_slots
    from ppoflow.tasks.replay import update_blocks
    from ppoflow.tasks.run.context import open_run, worker_groups

    cfg = experiment_config(args.experiment)
    paths = ExperimentPaths.of(cfg)
    rows = checkpoint_sizes(paths, 10**9)
    written = sorted(r["iteration"] for r in rows if r["role"] == args.role and r["complete"])
    first = args.first if args.first is not None else (written[-2] if len(written) > 1 else None)
    last = args.last if args.last is not None else (written[-1] if written else None)
    if first is None or last is None or first >= last or not {first, last} <= set(written):
        raise SystemExit(f"needs two complete {args.role} checkpoints A < B; complete on storage: {written}")
    method = f"update_{args.role}"
    batches = [paths.file(k, "advantages.arrow") for k in range(first + 1, last + 1)]
    missing = [b for b in batches if not storage.exists(b)]
    if missing:
        raise SystemExit(f"the batches {missing} are not on storage")
    scratch = storage.join(paths.root, "scratch", f"replay-bench-{uuid.uuid4().hex[:8]}")
    key = f"replay-bench-{uuid.uuid4().hex[:8]}"
    ctx = open_run(key, cfg, roles={args.role: args.role})
    seconds: list[float] = []
    try:
        with worker_groups(key), device_slots(cfg, print, run_id=key, wait_log=print):
            t0 = time.perf_counter()
            ctx.groups.group(args.role, paths.checkpoint(args.role, first))
            start_s = time.perf_counter() - t0
            for batch in batches:
                t0 = time.perf_counter()
                ctx.groups.call(args.role, method, batch, dp_blocks=update_blocks(cfg, method))
                seconds.append(time.perf_counter() - t0)
            out = storage.join(scratch, args.role)
            ctx.groups.call(args.role, "save_checkpoint", out, extra={"replayed_to": last})
        replayed = load_full_state_dict(out, verify=False)
        trained = load_full_state_dict(paths.checkpoint(args.role, last), verify=False)
    finally:
        if storage.exists(scratch):
            storage.rm(scratch, recursive=True)
    diffs = {
        k: float((replayed[k].double() - trained[k].double()).abs().max()) if replayed[k].numel() else 0.0
        for k in trained
    }
    worst = max(diffs, key=lambda k: diffs[k])
    scale = float(trained[worst].double().abs().max())
    identical = all(torch.equal(replayed[k], trained[k]) for k in trained)
    lines = [
        f"replay benchmark: {args.role} of {paths.root}, snapshot {first} -> {last} "
        f"({len(batches)} updates, {cfg.resources.nprocs} rank(s) on {cfg.resources.device})",
        f"group start + load of snapshot {first}: {start_s:.2f} s",
        f"updates replayed: {sum(seconds):.2f} s, {sum(seconds) / len(seconds):.3f} s per update "
        f"(each: {', '.join(f'{s:.2f}' for s in seconds)})",
        f"bit-identical to checkpoint {last}: {'yes' if identical else 'no'}; "
        f"tensors that differ: {sum(d > 0 for d in diffs.values())} of {len(diffs)}; largest |difference| "
        f"{diffs[worst]:.3e} in {worst} (its largest |value| {scale:.3e})",
    ]
    print("\n".join(lines))
    summary = {
        "role": args.role,
        "from": first,
        "to": last,
        "start_s": start_s,
        "update_s": seconds,
        "bit_identical": identical,
        "max_abs_diff": diffs[worst],
        "max_abs_diff_tensor": worst,
        "tensors_differing": sum(d > 0 for d in diffs.values()),
        "tensors": len(diffs),
    }
    print("summary: " + json.dumps(summary))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "replay_bench.json"), "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
