"""Do two processes' kernels run side by side on one GPU? A compute-bound workload (bf16 matmuls)
and a memory-bound one (1 GiB device copies), each in a process of its own: alone, together, and
together under CUDA MPS (a private control daemon this script starts and stops, when
``nvidia-cuda-mps-control`` is on the PATH). Prints each one's rate and the two rates' shares of
their rates alone summed: about 1.0 when the device runs the processes by turns (time slicing),
up to 2.0 when they overlap fully. It is what bounds asynchronous training on one GPU, where the
rollout producer and the trainer are such processes (docs/async.md).

    python benchmarks/process_overlap.py [--seconds 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def workload(kind: str, seconds: float, start_at: float) -> None:
    """Run ``kind`` from ``start_at`` (epoch seconds) for ``seconds``; print ``kind rate``."""
    import torch

    if kind == "compute":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)

        def step() -> None:
            torch.mm(a, b)
    else:
        x = torch.empty(2**30, device="cuda", dtype=torch.uint8)
        y = torch.empty_like(x)

        def step() -> None:
            y.copy_(x)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n += 10
    print(f"{kind} {n / (time.perf_counter() - t0):.2f}", flush=True)


def run(kinds: list[str], seconds: float, env: dict[str, str]) -> dict[str, float]:
    """``kinds`` in processes of their own, started together; their rates (steps per second)."""
    start_at = time.time() + 12  # every process has built its tensors by then
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--workload",
                k,
                "--seconds",
                str(seconds),
                "--start-at",
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in kinds
    ]
    rates = {}
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a workload process failed (exit {p.returncode})")
        kind, rate = out.split()[-2:]
        rates[kind] = float(rate)
    return rates


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--workload", choices=("compute", "memory"), help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workload:
        workload(args.workload, args.seconds, args.start_at)
        return
    env = dict(os.environ)
    alone = {**run(["compute"], args.seconds, env), **run(["memory"], args.seconds, env)}
    rows = [("alone (each by itself)", alone), ("together", run(["compute", "memory"], args.seconds, env))]
    control = shutil.which("nvidia-cuda-mps-control")
    if control:
        pipes = tempfile.mkdtemp(prefix="ppoflow-mps-")
        mps = {**env, "CUDA_MPS_PIPE_DIRECTORY": pipes, "CUDA_MPS_LOG_DIRECTORY": pipes}
        subprocess.run([control, "-d"], env=mps, check=True)
        try:
            rows.append(("together, under MPS", run(["compute", "memory"], args.seconds, mps)))
        finally:
            subprocess.run([control], input="quit\n", text=True, env=mps, check=False)
            shutil.rmtree(pipes, ignore_errors=True)
    else:
        rows.append(("together, under MPS", {}))
    print(f"{'':<26}{'compute steps/s':>16}{'memory steps/s':>16}{'summed share':>14}")
    for name, r in rows:
        if not r:
            print(f"{name:<26}{'(no nvidia-cuda-mps-control on the PATH)':>46}")
            continue
        share = sum(r[k] / alone[k] for k in r) if name != rows[0][0] else 1.0
        print(f"{name:<26}{r['compute']:>16.1f}{r['memory']:>16.1f}{share:>14.2f}")


if __name__ == "__main__":
    main()
