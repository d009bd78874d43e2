"""ppoflow.tasks.generate: what a rollout's randomness depends on."""

from __future__ import annotations


def test_iteration_seed_depends_on_the_seeds_and_the_iteration_only():
    from ppoflow.tasks.generate import iteration_seed

    assert iteration_seed(7, 0, 3) == iteration_seed(7, 0, 3)
    assert len({iteration_seed(7, 0, n) for n in range(1, 50)}) == 49
    assert iteration_seed(8, 0, 3) != iteration_seed(7, 0, 3) != iteration_seed(7, 1, 3)
    assert 0 <= iteration_seed(7, 0, 3) < 2**31
