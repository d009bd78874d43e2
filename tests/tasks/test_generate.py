"""ppoflow.tasks.generate: what a rollout's randomness depends on; dynamic sampling's selection."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.tasks.generate import keep_informative_groups, round_seed


def test_iteration_seed_depends_on_the_seeds_and_the_iteration_only():
    from ppoflow.tasks.generate import iteration_seed

    assert iteration_seed(7, 0, 3) == iteration_seed(7, 0, 3)
    assert len({iteration_seed(7, 0, n) for n in range(1, 50)}) == 49
    assert iteration_seed(8, 0, 3) != iteration_seed(7, 0, 3) != iteration_seed(7, 1, 3)
    assert 0 <= iteration_seed(7, 0, 3) < 2**31


def test_keep_informative_groups_drops_equal_groups_and_stops_at_the_wanted_count():
    uids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.2, 0.3]  # b scored alike
    batch = DataProto.from_dict({"x": torch.arange(8)}, {"uid": np.asarray(uids, dtype=object)})
    kept, total, alike = keep_informative_groups(batch, scores, wanted=2)
    assert (total, alike) == (4, 1)
    assert kept.non_tensor_batch["uid"].tolist() == ["a", "a", "c", "c"]
    assert kept.batch["x"].tolist() == [0, 1, 4, 5]


def test_round_zero_samples_with_the_iteration_seed_and_rounds_differ():
    from ppoflow.tasks.generate import iteration_seed

    assert round_seed(7, 0, 3, 0) == iteration_seed(7, 0, 3)
    assert len({round_seed(7, 0, 3, r) for r in range(5)}) == 5
    assert round_seed(7, 0, 3, 2) == round_seed(7, 0, 3, 2)
