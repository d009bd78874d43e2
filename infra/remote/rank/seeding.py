"""The start of a rank's global random generators: python's, numpy's and torch's (CPU and every
CUDA device).

    seed_rngs(rank)        # the rank entry, before it builds the worker
    seed_rngs(cfg.seed)    # a worker's init_model, before it builds its models
    with preserved_rngs(): ...   # what reseeds them inside (a rollout engine's start) is undone

A new process starts them from OS entropy; seeding them at a known point makes two runs of one
config hold (and save in their checkpoints) the same states. This lives with the rank runtime
because only rank code seeds them; the checkpoint reads and restores the states of these same
generators (``ppoflow.infra.checkpoint.state.rng_state``), whatever seeded them.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["seed_rngs", "preserved_rngs"]


def seed_rngs(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators (torch's CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def preserved_rngs() -> Iterator[None]:
    """Leave python's, numpy's and torch's generators (CPU and CUDA) as they were before the block,
    whatever reseeds them inside (a rollout engine's start does)."""
    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
