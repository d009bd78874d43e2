"""The failure block (``ppoflow.cli.failure``) for each kind of error, without running a flow:
what the user is told the cause is, where the experiment stands, and what to do next."""

from __future__ import annotations

import errno
import os

import pytest
from prefect import flow, task

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
from ppoflow.tasks.step import TASK_OPTIONS
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


def test_a_device_out_of_memory_says_what_makes_the_run_fit(cfg):
    import torch

    cuda_oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 228.00 MiB. GPU 0 ...")
    engine_oom = RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62")
    for exc in (in_rank(cuda_oom), in_rank(engine_oom), cuda_oom):
        text = block(cfg, exc)
        assert "  next   the device ran out of memory: give the updates fewer tokens at a time" in text, text
        assert "model.enable_gradient_checkpointing" in text and "rollout.kv_cache_gib" in text
        assert f"then run: {RERUN}" in text and "asynchronous" not in text
    sharing = cfg.model_copy(update={"asynchronous": cfg.asynchronous.model_copy(update={"enable": True})})
    text = block(sharing, in_rank(cuda_oom))
    assert "the producer's engine stays awake beside the updates" in text and "asynchronous.producer" in text
    assert "the device ran out of memory" not in block(cfg, in_rank(RuntimeError("shape mismatch")))


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


def _full(path: str) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@task(name="evaluate", task_run_name="evaluate-1", **TASK_OPTIONS)
def _evaluate_on_a_full_disk(path: str) -> dict:
    raise _full(path)


@task(name="commit", task_run_name="commit-1", **TASK_OPTIONS)
def _commit(evaluation: dict) -> int:
    return 1


@flow(name="full-disk-in-evaluate")
def _iteration(path: str) -> int:
    """The shape of an iteration's end: the commit takes the evaluation's output, so when the
    evaluation fails the commit never runs, and its result is asked for."""
    evaluated = _evaluate_on_a_full_disk.submit(path)
    return _commit.submit(evaluated).result()


def test_a_task_that_waited_on_a_failed_one_is_not_the_cause(cfg, prefect_harness):
    """Prefect leaves a task whose input failed PENDING; the flow then fails with "UnfinishedRun:
    Run is in PENDING state", which says nothing. The block names the failed task's own error
    (here a full disk met by the evaluation) and its way out, as when it fails the flow itself."""
    from prefect.exceptions import UnfinishedRun

    url = os.path.join(cfg.storage.experiment_url, "iterations", "000001", "eval", "val", "generations.arrow")
    state = _iteration(url, return_state=True)
    exc = state.result(raise_on_failure=False)
    assert isinstance(exc, UnfinishedRun)  # what the flow itself says
    lines: list[str] = []
    run = {"exception": exc, "flow_run_id": str(state.state_details.flow_run_id), "wall_s": 3.0}
    print_failure(cfg, run, rerun=RERUN, out=lines.append)
    text = "\n".join(lines)
    assert (
        "ppoflow: the run failed in task evaluate-1 (1 attempt, not retried: a retry cannot fix this)" in text
    )
    assert f"  cause  OSError: [Errno 28] No space left on device: '{url}'" in text
    assert f"  next   free space where the experiment is stored ({cfg.storage.experiment_url}" in text
    assert "UnfinishedRun" not in text and "PENDING" not in text
