"""Deterministic kernels for the updates (``resources.deterministic``).

An update between two snapshots is replayed when its state is needed again (tasks/replay.py); the
replay equals the lost state bit for bit only if the update's kernels are deterministic. On CPU
they are. On GPUs several are not by default (FlashAttention's backward accumulates dQ with
atomics, some index/scatter backwards, cuBLAS split-K reductions with a shared workspace, Inductor's
autotuning that may pick another kernel in a new process). With the switch on, every update runs
under ``torch.use_deterministic_algorithms(True)`` (strict: FlashAttention's deterministic
backward, deterministic index/scatter kernels, and an error naming any op that has none), cuDNN's
deterministic algorithms, and the cuBLAS workspace the group's launcher fixed
(``CUBLAS_WORKSPACE_CONFIG``, infra/config/system.py ``DETERMINISTIC_ENV``). Generation and the log-prob passes are not affected: a replay reads
their results from the stored batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["deterministic_updates"]


@contextmanager
def deterministic_updates(enabled: bool) -> Iterator[None]:
    """Run the block with deterministic kernels when ``enabled``; restore the previous mode after."""
    if not enabled:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
