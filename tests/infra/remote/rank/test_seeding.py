"""A rank's generators from one seed: the same seed gives the same draws and the same states a
checkpoint saves; another seed other ones."""

from __future__ import annotations

import random

import numpy as np
import torch

from ppoflow.infra.checkpoint.state import rng_state
from ppoflow.infra.remote.rank.seeding import seed_rngs


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_one_seed_gives_one_start_for_every_generator_a_checkpoint_saves():
    seed_rngs(7)
    state, draws = rng_state(), _draws()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # anything in between
    seed_rngs(7)
    assert rng_state() == state and _draws() == draws
    seed_rngs(8)
    other = _draws()
    assert all(a != b for a, b in zip(other, draws))
