"""The failure block (``ppoflow.cli.failure``) for each kind of error, without running a flow:
what the user is told the cause is, where the experiment stands, and what to do next."""

from __future__ import annotations

import os

import pytest

from ppoflow.cli.failure import cause_text, print_failure
from ppoflow.infra.checkpoint.sharded import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ppoflow.infra.config import parse_config
from ppoflow.infra.data.prompts import DataError
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.remote.errors import RankFailure, error_types
from tests.support.experiments import commit_tiny_iterations

RERUN = "ppoflow run exp.yaml --iterations 2"


@pytest.fixture
def cfg(tmp_path):
    """An experiment with iterations 0 and 1 committed (tiny checkpoints, real manifests)."""
    cfg = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["x.parquet"], "train_batch_size": 4},
            "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 4},
            "critic": {"enable": False},
            "algorithm": {"adv_estimator": "grpo"},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )
    commit_tiny_iterations(cfg, last=1)
    return cfg


def block(cfg, exc, verbose=False) -> str:
    lines: list[str] = []
    run = {"exception": exc, "flow_run_id": None, "wall_s": 12.0, "committed_before": 1}
    print_failure(cfg, run, rerun=RERUN, verbose=verbose, out=lines.append)
    return "\n".join(lines)


def in_rank(exc: BaseException) -> RankFailure:
    return RankFailure(
        f"rank 1 raised in 'generate_sequences': {type(exc).__name__}: {exc}\n"
        f"--- rank 1 traceback ---\nTraceback (most recent call last):\n  ...\n{type(exc).__name__}: {exc}",
        rank=1,
        method="generate_sequences",
        error_types=tuple(error_types(exc)),
    )


def test_a_deterministic_error_in_a_rank_names_its_cause_not_its_traceback(cfg):
    text = block(cfg, in_rank(DataError("row 7 of train.parquet has no prompt")))
    assert text.splitlines()[1] == "ppoflow: the run failed after 12 s"
    assert (
        "  cause  RankFailure: rank 1 raised in 'generate_sequences': DataError: row 7 of train.parquet"
        in text
    )
    assert "(the ranks' traceback and output are in the log)" in text and "Traceback" not in text
    assert (
        "  state  iteration 1 is the last committed (this run committed none); the experiment lock "
        "and this run's device slots are free" in text
    )
    assert f"  next   fix what the cause names (a retry cannot), then run: {RERUN}" in text


def test_a_transient_error_says_run_again_and_verbose_adds_the_traceback(cfg):
    try:
        raise OSError(121, "We encountered an internal error. Please try again.")
    except OSError as exc:
        err = exc
    text = block(cfg, err)
    assert (
        f"  next   run the same command again: {RERUN}" in text
        and "resumes at the first unfinished task" in text
    )
    assert "Traceback" not in text
    assert "Traceback (most recent call last)" in block(cfg, err, verbose=True)


def test_an_unusable_checkpoint_points_back_to_the_last_good_iteration(cfg):
    paths = ExperimentPaths.of(cfg)
    for exc in (
        IncompleteCheckpointError("incomplete checkpoint ...: no marker"),
        in_rank(IncompleteCheckpointError("no marker")),
        CorruptCheckpointError("checkpoint ... is damaged; 1 file(s) do not match its marker"),
    ):
        text = block(cfg, exc)
        assert (
            f"  next   move the experiment back to iteration 0: ppoflow rollback {paths.root} --to 0" in text
        )


def test_a_lock_left_behind_is_reported_not_hidden(cfg):
    paths = ExperimentPaths.of(cfg)
    with ExperimentLock(paths.lock, run_id="someone-else"):
        text = block(cfg, RuntimeError("boom"))
    assert f"the experiment lock {paths.lock} is still there (another run's?)" in text
    assert not os.path.exists(paths.lock)


def test_long_causes_are_cut():
    text = cause_text(ValueError("\n".join(f"line {i}" for i in range(100))))
    lines = text.splitlines()
    assert len(lines) == 25 and lines[-1].strip() == "... (the rest is in the log)"
    assert cause_text(None) == "unknown (see the log)"
