"""ppoflow.tasks.evaluate: which iterations training evaluates."""

from __future__ import annotations

from ppoflow.infra.config import apply_overrides, parse_config
from ppoflow.tasks.evaluate import due

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["d.parquet"], "val_files": ["v.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
}


def _cfg(**over):
    return parse_config(apply_overrides(dict(BASE), over), source="evaluate test")


def test_every_kth_iteration_and_the_last_of_a_run_with_held_out_files():
    cfg = _cfg(**{"evaluation.every": 3, "evaluation.at_end": True})
    assert [n for n in range(1, 10) if due(cfg, n, last_of_run=False)] == [3, 6, 9]
    assert due(cfg, 4, last_of_run=True)
    cfg = _cfg(**{"evaluation.every": 0, "evaluation.at_end": False})
    assert not any(due(cfg, n, last_of_run=n == 5) for n in range(1, 6))
    no_files = _cfg(**{"data.val_files": [], "evaluation.every": 1})
    assert not due(no_files, 1, last_of_run=True)
