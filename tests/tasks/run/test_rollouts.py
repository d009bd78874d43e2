"""ppoflow.tasks.run.rollouts: the synchronous source does nothing at any point of a run (the
iteration's ``generate`` samples), and it is what a context holds unless the session passes
another. The queue's source: tests/flows/asynchronous/test_source.py."""

from __future__ import annotations

from ppoflow.infra.config import parse_config
from ppoflow.tasks.run import SYNCHRONOUS, RolloutSource, SynchronousRollouts, close_run, open_run


def test_the_synchronous_source_starts_removes_and_stops_nothing(tmp_path):
    source: RolloutSource = SynchronousRollouts()
    source.start(3)
    source.check()
    assert source.after_commit(4) == []
    source.stop(failed=True)
    cfg = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )
    ctx = open_run("run-sync", cfg)
    try:
        assert ctx.rollouts is SYNCHRONOUS
        ctx.check_rollouts()  # no lock, no producer: nothing to raise
    finally:
        close_run("run-sync")
