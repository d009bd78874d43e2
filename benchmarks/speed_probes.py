"""How fast this machine's CPU core and GPU are right now: short fixed workloads that the
benchmarks run just before each timed generation, so a change in tokens/s between two runs can be
laid beside a change in the machine under them.

Why it is needed: a decode step of vLLM at the quickstart shape is Python on one thread (scheduler,
input preparation, sampler bookkeeping) around a few milliseconds of CUDA graphs, and the thread's
CPU time says nothing about which of the two bounds it: while the GPU works the thread waits in a
CUDA synchronize, and CUDA's default schedule for a process with fewer contexts than cores is to
spin, so the thread's CPU seconds match the wall time either way (measured on the H200:
2.196-2.207 s of CPU in 2.196-2.207 s runs). Plain vLLM's runs at one setting on one machine moved
from 3.11 s to 2.20 s between two calls ten minutes apart; these probes say whether the core or
the GPU moved with them.

- :func:`python_rate`: millions of iterations per second of a fixed pure-Python loop (integer
  arithmetic and a dict store, the kind of work the engine's scheduler does), best of ``repeats``.
- :func:`gpu_rates`: bf16 matmul TFLOP/s and device-to-device copy GB/s (decoding a small model is
  bound by memory reads), best of ``repeats``; empty without CUDA.
"""

from __future__ import annotations

import time

__all__ = ["python_rate", "gpu_rates", "probe", "describe"]


def python_rate(iterations: int = 200_000, repeats: int = 3) -> float:
    """Millions of loop iterations per second of one fixed pure-Python loop (best of ``repeats``)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        acc, table = 0, {}
        for i in range(iterations):
            acc = (acc * 31 + i) & 0xFFFFFFFF
            table[i & 1023] = acc
        best = min(best, time.perf_counter() - t0)
    return iterations / best / 1e6


def gpu_rates(size: int = 8192, copy_gib: float = 1.0, repeats: int = 3) -> dict[str, float]:
    """``{"gpu_tflops": ..., "gpu_copy_gbs": ...}`` on the current CUDA device (best of ``repeats``,
    each 10 matmuls of ``size`` x ``size`` and one copy of ``copy_gib`` GiB read + written); ``{}``
    without CUDA. Allocates ~``2 * copy_gib`` GiB for a moment."""
    import torch

    if not torch.cuda.is_available():
        return {}
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    src = torch.empty(int(copy_gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mm_s, copy_s = float("inf"), float("inf")
    torch.mm(a, b, out=c)  # cuBLAS picks its kernel on first use
    for _ in range(repeats):
        start.record()
        for _ in range(10):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        mm_s = min(mm_s, start.elapsed_time(end) / 1e3 / 10)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        copy_s = min(copy_s, start.elapsed_time(end) / 1e3)
    del a, b, c, src, dst
    torch.cuda.empty_cache()
    return {"gpu_tflops": 2 * size**3 / mm_s / 1e12, "gpu_copy_gbs": 2 * copy_gib * 2**30 / copy_s / 1e9}


def probe(gpu: bool) -> dict[str, float]:
    """``python_mops`` (and with ``gpu`` the :func:`gpu_rates`), about 0.1 s in all."""
    out = {"python_mops": python_rate()}
    if gpu:
        out.update(gpu_rates())
    return out


def describe(p: dict[str, float]) -> str:
    """One short phrase for a log line: "core 21.3 Mit/s, GPU 690 TFLOP/s, copy 3900 GB/s"."""
    parts = [f"core {p['python_mops']:.1f} Mit/s"] if "python_mops" in p else []
    if "gpu_tflops" in p:
        parts.append(f"GPU {p['gpu_tflops']:.0f} TFLOP/s, copy {p['gpu_copy_gbs']:.0f} GB/s")
    return ", ".join(parts)
