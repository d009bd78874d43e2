"""Deterministic kernels for the updates, strict inside the block and restored after it."""

from __future__ import annotations

import torch


def test_deterministic_updates_are_strict_inside_and_restore_the_mode_after():
    from ppoflow.workers.determinism import deterministic_updates

    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_updates(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    with deterministic_updates(False):
        assert not torch.are_deterministic_algorithms_enabled()
