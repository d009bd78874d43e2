"""``benchmarks/speed_probes.py`` and the paired ratio of ``benchmarks/rollout_cycle.py``: the core probe
sees a core that is shared (another thread holding the GIL half the time), the GPU probe stays out of
the way without CUDA, and the paired line divides each cycle's rollout by the plain run beside it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import threading
import time

import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _alone_and_shared(probes) -> tuple[float, float]:
    alone = probes.python_rate(iterations=200_000, repeats=3)  # best of three: the core's own speed
    stop = threading.Event()

    def spin():  # pure Python: holds the GIL for its switch interval, again and again
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        time.sleep(0.01)
        # one long run (~15 switch intervals), so no run can fall between the spinner's turns
        shared = probes.python_rate(iterations=500_000, repeats=1)
    finally:
        stop.set()
        t.join()
    return alone, shared


def test_core_probe_drops_when_another_thread_takes_the_gil():
    probes = _load("speed_probes")
    # The spinner gets about half of the interpreter, so the rate falls well below the rate alone. A
    # host busy with other processes can keep the spinner off the CPU for a whole run, so up to three
    # tries; a probe that timed its own thread's CPU instead of the wall clock would fail all three.
    tries = []
    for _ in range(3):
        alone, shared = _alone_and_shared(probes)
        assert alone > 0 and shared > 0
        tries.append((alone, shared))
        if shared < 0.8 * alone:
            return
    raise AssertionError(f"the probe did not see the GIL taken: (alone, shared) rates {tries}")


def test_gpu_probe_is_empty_without_cuda_and_the_phrase_names_what_was_measured():
    probes = _load("speed_probes")
    if not torch.cuda.is_available():
        assert probes.gpu_rates() == {}
        assert set(probes.probe(gpu=False)) == {"python_mops"}
    assert probes.describe({"python_mops": 4.25}) == "core 4.2 Mit/s"
    assert probes.describe({"python_mops": 7.0, "gpu_tflops": 793.6, "gpu_copy_gbs": 3784.4}) == (
        "core 7.0 Mit/s, GPU 794 TFLOP/s, copy 3784 GB/s"
    )


def test_paired_ratio_divides_each_rollout_by_the_plain_run_of_its_cycle():
    cycle = _load("rollout_cycle")
    idle = [{"rollout/tokens_per_s": v, "probe/python_mops": 4.0} for v in (30_000.0, 33_000.0, 20_000.0)]
    plain = [{"rollout/tokens_per_s": v, "probe/python_mops": 4.0} for v in (30_000.0, 30_000.0, 25_000.0)]
    bench = argparse.Namespace(preset="tiny", device="cpu", prompts=8, prompt_len=32, response_len=16)
    text = cycle.report(bench, argparse.Namespace(cycles=3), {"idle": idle, "plain": plain})
    line = next(x for x in text.splitlines() if x.startswith("ppoflow's rollout / vLLM's generate"))
    # by hand: 30/30, 33/30, 20/25 -> 1.00, 1.10, 0.80; median 1.00
    assert line.endswith("cycle by cycle: 1.00, 1.10, 0.80 (median 1.00x)"), line
    assert any(x.startswith("core before (Mit/s)") and x.split()[-1] == "4.0" for x in text.splitlines())
