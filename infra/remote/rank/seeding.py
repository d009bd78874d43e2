"""The start of a rank's global random generators: python's, numpy's and torch's (CPU and every
CUDA device).

    seed_rngs(rank)        # the rank entry, before it builds the worker
    seed_rngs(cfg.seed)    # a worker's init_model, before it builds its models

A new process starts them from OS entropy; seeding them at a known point makes two runs of one
config hold (and save in their checkpoints) the same states. This lives with the rank runtime
because only rank code seeds them; the checkpoint reads and restores the states of these same
generators (``ppoflow.infra.checkpoint.state.rng_state``), whatever seeded them.
"""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_rngs"]


def seed_rngs(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators (torch's CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
