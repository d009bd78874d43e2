"""Device memory helpers (``device_memory``) off CUDA: every figure 0.0 or empty and nothing given
back, so CPU runs carry no memory metrics."""

from __future__ import annotations

import torch


def test_memory_helpers_report_nothing_off_cuda():
    from ppoflow.workers.device_memory import (
        PeakMemory,
        engine_pool_bytes,
        release_cached,
        release_for_wake,
        resident_gib,
    )

    with PeakMemory("cpu") as mem:
        torch.zeros(1000)
    assert (mem.on, mem.gib) == (False, 0.0)
    assert resident_gib("cpu") == 0.0
    release_cached("cpu")
    assert release_for_wake("cpu") is False
    assert engine_pool_bytes() == {}  # no vLLM sleep-mode pool in this process
