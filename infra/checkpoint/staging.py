"""Host copies of a rank's state trees for background checkpoint writes: :class:`HostStager`
copies the tensors once, so training may change the live ones at once while the write goes on."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostStager"]


def _layout(tree: Any, prefix: str = "") -> tuple:
    """The shape of a state tree: every leaf's path, type, shape and dtype (buffers are reused
    while it stays the same)."""
    if isinstance(tree, dict):
        return tuple(item for key in sorted(tree) for item in _layout(tree[key], f"{prefix}{key}."))
    if isinstance(tree, torch.Tensor):
        return ((prefix, type(tree).__name__, tuple(tree.shape), str(tree.dtype), tree.device.type),)
    return ((prefix, type(tree).__name__),)


class HostStager:
    """Copies state trees into host memory (pinned when the tensors live on CUDA), into buffers
    allocated on first use and reused while the tree's layout stays the same. torch's own
    ``_create_cpu_state_dict`` / ``_copy_state_dict`` do the work (they keep DTensor structure;
    DCP's ``BlockingAsyncStager`` is built on them, in torch 2.11 through 2.13; the newer
    ``DefaultStager`` fails on these trees in torch 2.11)."""

    def __init__(self) -> None:
        self._buffers: dict[str, tuple[tuple, dict]] = {}

    def stage(self, name: str, tree: dict) -> dict:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(tree)
        cached = self._buffers.get(name)
        cuda = any(leaf[-1] == "cuda" for leaf in layout if len(leaf) == 5)
        if cached is None or cached[0] != layout:
            cached = (layout, _create_cpu_state_dict(tree, pin_memory=cuda))
            self._buffers[name] = cached
        staged = _copy_state_dict(tree, cached[1], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        self._buffers.clear()
