"""The actor rank's update -> rollout cycle on one GPU, stage by stage, with and without a checkpoint
being written behind it: where generation and weight-sync time goes inside the flow's worker.

It builds the flow's own actor worker (``ActorRolloutRefWorker``, role ``actor_rollout``: FSDP2
policy, AdamW, the vLLM engine asleep) in this process, as a one-rank torch.distributed world
(gloo + NCCL, as a rank of the flow's worker group), from the config ``benchmarks/iteration.py``
makes for the same flags. Every cycle is what one iteration does on that rank:

    update_actor(batch)  ->  [save_checkpoint(background=True)]  ->  generate_sequences(prompts)

(``generate_sequences``: release torch's cached blocks, wake the engine's weights, push the
actor's weights, wake the KV cache, generate, sleep, then the actor's old log-probs.) Conditions,
``--cycles`` each after one warm-up cycle:

    idle          nothing else runs
    write-here    the actor's checkpoint (model + AdamW, the flow's CheckpointWriter) is written by
                  this process's writer thread while the rollout runs (the flow's actor group)
    write-other   another process writes as many bytes to the same disk meanwhile (the flow's
                  critic group writing its own checkpoint)
    write-both    both at once: what a warm iteration of the flow with a critic overlaps its
                  rollout with (the previous iteration's two background writes)
    lp            idle, with ``rollout.calculate_log_probs`` on (vLLM's log-probs of the samples;
                  the others run with the config's value, off unless ``--rollout-log-probs``)
    plain         idle, but the rollout is vLLM's own ``LLM.generate`` on the worker's engine (inside
                  the same sharding manager: weights pushed, engine woken, put to sleep after), the
                  requests as ``vllm_reference.py`` makes them (seed each, T=1, ``ignore_eos``), no
                  ppoflow code between: beside ``idle`` it prices ppoflow's rollout against vLLM on
                  one engine in one process, cycle by cycle, whatever the machine does meanwhile

The conditions take turns (cycle 1 of each, then cycle 2 of each, ...), so a machine that speeds up
or slows down during the run moves them all alike; before every generation the core's and the GPU's
speed are probed (``speed_probes.py``) and printed with it. The GPU probe empties torch's cache
after itself, so "cache release" has nothing left to release on a GPU.

    python benchmarks/rollout_cycle.py --preset qwen2.5-0.5b --device cuda --prompts 256 \\
        --prompt-len 512 --response-len 256 --micro-batch 32 --log-prob-micro-batch 32 --dynamic-bsz

Every flag but ``--cycles``, ``--conditions`` and ``--workdir`` is ``benchmarks/iteration.py``'s (one
rank). Prints one table: median seconds per stage and condition, generation tokens/s, and with ``idle``
and ``plain`` both run, ppoflow's tokens/s over vLLM's cycle by cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CONDITIONS = ("idle", "write-here", "write-other", "write-both", "lp", "plain")
STAGES = [
    ("update_actor", "update_s"),
    ("checkpoint staging", "stage_s"),
    ("generate_sequences (all)", "rollout_call_s"),
    ("  weight sync", "rollout/weight_sync_s"),
    ("    cache release", "rollout/release_s"),
    ("    wake (both tags)", "rollout/wake_s"),
    ("    push", "rollout/push_s"),
    ("  generation", "rollout/generate_s"),
    ("    of which GC", "rollout/gc_s"),
    ("    decoding thread's CPU", "perf/rollout_thread_cpu_s"),
    ("  sleep", "rollout/sleep_s"),
    ("  old log-probs", "perf/old_log_prob_s"),
]

_WRITER = """
import os, sys
path, total = sys.argv[1], int(sys.argv[2])
chunk = os.urandom(64 << 20)
with open(path, "wb") as f:
    done = 0
    while done < total:
        f.write(chunk)
        done += len(chunk)
    f.flush()
    os.fsync(f.fileno())
os.remove(path)
"""


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=list(CONDITIONS))
    p.add_argument("--workdir", default=None, help="model, checkpoints (default: a temp dir)")
    own, rest = p.parse_known_args(argv)
    from iteration import parse_args as iteration_args

    bench = iteration_args([*rest, "--ranks", "1", "--engine", "vllm"])
    return own, bench


def make_prompts(n: int, length: int, seed: int):
    import torch

    from ppoflow.infra.data.dataproto import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 250, (n, length), generator=g)
    return DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(length).expand(n, length).clone(),
        },
        meta_info={"seed": seed},
    )


def checkpoint_bytes(url: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(url):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def main(argv=None) -> None:
    own, bench = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = own.workdir or tempfile.mkdtemp(prefix="ppoflow-cycle-")
    os.makedirs(work, exist_ok=True)
    import torch
    from iteration import build_model, experiment_config
    from speed_probes import describe, probe
    from vllm_reference import one_rank_world

    from ppoflow.infra.config import parse_config
    from ppoflow.workers.actor_rollout_ref_worker import ActorRolloutRefWorker

    t0 = time.perf_counter()
    model_dir = os.path.join(work, "model")
    n_params = build_model(model_dir, bench.preset, bench.prompt_len + bench.response_len + 8)
    cfg = parse_config(experiment_config(bench, model_dir, os.path.join(work, "unused.parquet"), work))
    os.environ.update(LOCAL_WORLD_SIZE="1", PPOFLOW_DEVICE=bench.device)  # what the rank entry sets
    gpu = bench.device == "cuda"
    one_rank_world(gpu)
    worker = ActorRolloutRefWorker({"config": cfg.model_dump(mode="json"), "role": "actor_rollout"})
    info = worker.init_model()
    print(
        f"built {n_params / 1e6:.1f}M params and the actor worker in {time.perf_counter() - t0:.1f} s: "
        f"{json.dumps(info.get('rollout', {}))}",
        flush=True,
    )

    seeds = iter(range(1000, 10**6))
    ckpts = iter(range(10**6))
    last_batch = {}

    def update() -> float:
        if not last_batch:
            return 0.0
        data = last_batch["data"]
        t = time.perf_counter()
        worker.update_actor(data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t

    def plain(row: dict[str, float]) -> dict[str, float]:
        """vLLM's own generate on the worker's engine, woken and filled with the actor's weights by
        the worker's sharding manager as the rollout is."""
        from vllm.inputs import TokensPrompt
        from vllm_reference import _params, _timed_generate

        seed = next(seeds)
        ids = make_prompts(bench.prompts, bench.prompt_len, seed).batch["input_ids"]
        requests = [TokensPrompt(prompt_token_ids=r) for r in ids.tolist()]
        params = _params("seed+nolp", bench.prompts, bench.response_len, 7919 * seed)
        t = time.perf_counter()
        with worker.sharding_manager:
            seconds, tokens, _, cpu = _timed_generate(worker.rollout.llm, requests, params)
        row["rollout_call_s"] = time.perf_counter() - t
        row.update(
            {
                "rollout/generate_s": seconds,
                "rollout/tokens_per_s": tokens / seconds,
                "rollout/weight_sync_s": worker.sharding_manager.last_sync_s,
                **{f"rollout/{k}": v for k, v in worker.sharding_manager.last_timing.items()},
                **cpu.metrics("perf/rollout_"),
            }
        )
        return row

    def cycle(condition: str) -> dict[str, float]:
        row: dict[str, float] = {"update_s": update()}
        row.update({f"probe/{k}": v for k, v in probe(gpu).items()})
        if condition == "plain":
            return plain(row)
        other = None
        worker.cfg.rollout.calculate_log_probs = condition == "lp" or bool(bench.rollout_log_probs)
        here = condition in ("write-here", "write-both")
        if here:
            t = time.perf_counter()
            worker.save_checkpoint(os.path.join(work, "ckpt", f"c{next(ckpts)}"), background=True)
            row["stage_s"] = time.perf_counter() - t
        if condition in ("write-other", "write-both"):
            size = last_batch.get("ckpt_bytes", 6 << 30)
            other = subprocess.Popen(
                [sys.executable, "-c", _WRITER, os.path.join(work, "other.bin"), str(size)]
            )
            time.sleep(0.5)  # let it get going
        t = time.perf_counter()
        out = worker.generate_sequences(make_prompts(bench.prompts, bench.prompt_len, next(seeds)))
        row["rollout_call_s"] = time.perf_counter() - t
        row.update({k: float(v) for k, v in out.meta_info["metrics"].items() if isinstance(v, (int, float))})
        if here:
            t = time.perf_counter()
            res = worker.wait_checkpoint() or {}
            row["write_left_s"] = time.perf_counter() - t
            row["write_s"] = (
                float(res.get("write_s", float("nan"))) if isinstance(res, dict) else float("nan")
            )
            shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)  # 6.5 GB each at 0.5B
        if other is not None:
            t = time.perf_counter()
            other.wait()
            row["write_left_s"] = row.get("write_left_s", 0.0) + time.perf_counter() - t
        out.batch["advantages"] = torch.randn(
            out.batch["responses"].shape, generator=torch.Generator().manual_seed(0)
        )
        last_batch["data"] = out
        return row

    # warm-up: one idle cycle (the first push and rollout), one update, one checkpoint (allocates the
    # pinned staging buffers) whose size the write-other condition copies
    cycle("idle")
    cycle("idle")
    worker.save_checkpoint(os.path.join(work, "ckpt", "warm"), background=True)
    worker.wait_checkpoint()
    last_batch["ckpt_bytes"] = checkpoint_bytes(os.path.join(work, "ckpt", "warm"))
    shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
    print(f"warm-up done; checkpoint {last_batch['ckpt_bytes'] / 1e9:.2f} GB", flush=True)

    results: dict[str, list[dict[str, float]]] = {c: [] for c in own.conditions}
    for _ in range(own.cycles):
        for condition in own.conditions:  # in turns: drift of the machine moves every condition alike
            results[condition].append(cycle(condition))
            r = results[condition][-1]
            print(
                f"  {condition:12} generation {r.get('rollout/generate_s', 0):.3f} s "
                f"({r.get('rollout/tokens_per_s', 0):.0f} tok/s), weight sync {r.get('rollout/weight_sync_s', 0):.3f} s "
                f"(release {r.get('rollout/release_s', 0):.3f}, wake {r.get('rollout/wake_s', 0):.3f}, "
                f"push {r.get('rollout/push_s', 0):.3f}); decoding thread's CPU "
                f"{r.get('perf/rollout_thread_cpu_s', 0):.3f} s, host busy {r.get('perf/rollout_host_busy', 0):.0%} "
                f"stolen {r.get('perf/rollout_host_steal', 0):.1%}; before it: "
                + describe({k.removeprefix("probe/"): v for k, v in r.items() if k.startswith("probe/")}),
                flush=True,
            )
    print(report(bench, own, results))
    print("records: " + json.dumps(results))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "rollout_cycle.json"), "w") as f:
            json.dump({"args": vars(bench), "cycle_args": vars(own), "results": results}, f, indent=1)
    sys.stdout.flush()
    if not own.workdir:
        shutil.rmtree(work, ignore_errors=True)
    os._exit(0)  # vLLM's engine owns the process group's teardown (VLLMRollout.shutdown)


def report(bench, own, results: dict[str, list[dict[str, float]]]) -> str:
    conds = list(results)
    lines = [
        f"rollout cycle of one actor rank: {bench.preset}, {bench.device}, {bench.prompts} prompts x "
        f"({bench.prompt_len} + {bench.response_len}); median of {own.cycles} cycle(s) per condition, seconds",
        "",
        f"{'stage':28}" + "".join(f"{c:>13}" for c in conds),
    ]
    lines.append("-" * len(lines[-1]))

    def med(rows, key):
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    for label, key in [*STAGES, ("write left after rollout", "write_left_s")]:
        lines.append(f"{label:28}" + "".join(f"{med(results[c], key):13.3f}" for c in conds))
    lines.append(
        f"{'generation tokens/s':28}"
        + "".join(f"{med(results[c], 'rollout/tokens_per_s'):13.0f}" for c in conds)
    )
    best = [
        max((r.get("rollout/tokens_per_s", 0.0) for r in results[c]), default=float("nan")) for c in conds
    ]
    lines.append(f"{'  best cycle':28}" + "".join(f"{b:13.0f}" for b in best))
    for label, key, fmt in (
        ("core before (Mit/s)", "probe/python_mops", "13.1f"),
        ("GPU before (TFLOP/s)", "probe/gpu_tflops", "13.0f"),
        ("GPU copy before (GB/s)", "probe/gpu_copy_gbs", "13.0f"),
    ):
        if any(key in r for c in conds for r in results[c]):
            lines.append(f"{label:28}" + "".join(f"{med(results[c], key):{fmt}}" for c in conds))
    if "idle" in results and "plain" in results:
        pairs = [
            a["rollout/tokens_per_s"] / b["rollout/tokens_per_s"]
            for a, b in zip(results["idle"], results["plain"], strict=False)
        ]
        lines.append(
            f"ppoflow's rollout / vLLM's generate, same engine, cycle by cycle: {', '.join(f'{x:.2f}' for x in pairs)}"
            f" (median {statistics.median(pairs):.2f}x)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
