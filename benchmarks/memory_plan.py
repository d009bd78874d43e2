"""The memory plan of a benchmark shape, without weights: what preflight prints and refuses.

Takes :mod:`iteration`'s flags, writes only the model's ``config.json`` (a matrix row or a rung
of the size ladder at its real shape), builds the same experiment config the benchmark would run,
and prints the preflight's memory lines and, where it cannot fit, its refusal with the fixes.
The device's memory is read as preflight reads it (``nvidia-smi``), or given (``--gpu-gib``);
the host's free memory from ``/proc/meminfo`` or ``--host-gib``. Seconds, on any machine:

    python benchmarks/memory_plan.py --size qwen3-8b --estimator grpo --prompts 64 --n 4 \\
        --prompt-len 512 --response-len 512 --micro-batch 16 --dynamic-bsz --offload both \\
        --ranks 1 --gpu-gib 79.6 --host-gib 120     # --ranks: GPUs (iteration.py's default is 2)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import iteration


def host_free_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--gpu-gib", type=float, default=None, help="one GPU's memory (default: nvidia-smi)")
    own.add_argument("--host-gib", type=float, default=None, help="free host memory (default: /proc/meminfo)")
    mine, rest = own.parse_known_args(argv)
    args = iteration.parse_args(rest + ["--device", "cuda"])

    from ppoflow.demo.tiny_models import build_char_tokenizer
    from ppoflow.infra.architectures import real_config
    from ppoflow.infra.config import ExperimentConfig
    from ppoflow.infra.config.defaults import resolve_defaults
    from ppoflow.infra.preflight.memory_check import check_memory, gpu_capacity
    from ppoflow.infra.preflight.report import Checks

    tok = build_char_tokenizer()
    if args.size:
        name, overrides = iteration.SIZES[args.size]
    elif args.arch:
        name, overrides = args.arch, {}
    else:
        raise SystemExit("memory_plan.py: give --size or --arch (a shape with a config to read)")
    with tempfile.TemporaryDirectory() as model_dir:
        config = real_config(name, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **overrides)
        config.save_pretrained(model_dir)
        cfg = ExperimentConfig.model_validate(
            iteration.experiment_config(args, model_dir, os.path.join(model_dir, "p.parquet"), model_dir)
        )
        resolve_defaults(cfg)
        capacity = int(mine.gpu_gib * 2**30) if mine.gpu_gib else gpu_capacity(cfg)
        if capacity is None:
            raise SystemExit("memory_plan.py: no GPU memory figure here: give --gpu-gib")
        host = int(mine.host_gib * 2**30) if mine.host_gib else host_free_bytes()
        checks = Checks()
        check_memory(cfg, checks, capacity=capacity, host=host)
    print(
        f"memory plan of: {' '.join(rest)} (GPU {capacity / 2**30:.1f} GiB, host free {host / 2**30:.1f} GiB)"
    )
    for line in checks.report.passed + [f"note: {n}" for n in checks.report.notes]:
        print("  " + line)
    for p in checks.problems:
        print(f"  REFUSED {p.where}: {p.found}\n    fix: {p.fix}")
    return 1 if checks.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
