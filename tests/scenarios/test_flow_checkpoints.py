"""Background checkpoint writes in the real flow: faults during the write, before and after a
commit, a rank killed while it writes, and a rollback; each compared with the uninterrupted
``base_run`` (conftest: 2 iterations in one flow run) bit for bit. (Retention and rollback on
synthetic experiments: tests/infra/experiment/test_retention.py.)

1. A rank of each group is killed while it writes checkpoint 2: the run notices at commit 2,
   recomputes checkpoint 2 from its lineage (load 1, update again, save) and commits what the
   uninterrupted run committed.
2. Every write fails (storage errors on every attempt): the run fails, manifest 1 stays, the
   checkpoints of iteration 2 are never published (a failure record instead); the update
   receipts are not trusted; a rerun commits the base run's iteration 2.
3. Two iterations from iteration 0, commit 2 failing every time: iteration 2 ran while commit 1
   waited for its checkpoints; commit 1 lands, equal to the base run's; a rerun commits 2 equal to
   the base run's.
4. ``ppoflow rollback`` from 2 to 1, then a rerun: commits the base run's iteration 2.
"""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.checkpoint.marker import is_complete, read_failure
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit, copy_experiment

pytestmark = pytest.mark.slow


def task_runs(state) -> dict:
    """The task runs of the flow run behind ``state``, by name (``commit-2``, ...)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    return {r.name: r for r in runs}


def task_logs(state, task: str, needle: str, timeout_s: float = 20.0) -> str:
    """The log messages of task run ``task`` once one contains ``needle`` (they reach the API in
    batches)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    task_run = task_runs(state)[task]
    deadline = time.time() + timeout_s
    text = ""
    while time.time() < deadline:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run.id])))
        text = "\n".join(log.message for log in logs)
        if needle in text:
            break
        time.sleep(0.5)
    return text


def receipt_stamp(paths: ExperimentPaths, n: int, task: str) -> str:
    return storage.read_json(paths.receipt(n, task))["stamp"]


def test_rank_killed_while_writing_is_recomputed_within_the_run(base_run, flow_config, tmp_path, monkeypatch):
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp", at=1)
    faults.reset()
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:checkpoint_write:1")
    state = ppo(flow_config(str(tmp_path), "exp"), iterations=1, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    logs = task_logs(state, "commit-2", "recomputing it")
    for role in ("actor", "critic"):
        assert (
            f"{role}/000002 was lost before it was complete (the {role} group died while writing it)" in logs
        )
    assert_same_commit(base_run["url"], url, 2)


def test_failing_writes_never_publish_and_a_rerun_commits_the_same(
    base_run, flow_config, tmp_path, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp", at=1)
    paths = ExperimentPaths(url)
    # no task retries: the fault outlasts them all, and each would recompute both updates
    cfg = flow_config(str(tmp_path), "exp", **{"checkpoint.write_attempts": 1, "resources.task_retries": 0})
    faults.reset()
    monkeypatch.setenv(faults.ENV_VAR, "rank_raise:checkpoint_write:0:always")
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    assert "injected fault" in str(state.result(raise_on_failure=False))
    assert task_runs(state)["commit-2"].run_count == 1  # resources.task_retries reached the commit
    assert read_manifest(paths).iteration == 1
    for role in ("actor", "critic"):
        assert not is_complete(paths.checkpoint(role, 2))
        assert "injected fault" in read_failure(paths.checkpoint(role, 2))
        assert storage.exists(paths.receipt(2, f"update_{role}"))
    stamps = {task: receipt_stamp(paths, 2, task) for task in ("generate", "update_actor", "update_critic")}

    monkeypatch.delenv(faults.ENV_VAR)
    faults.reset()
    assert ppo(cfg, iterations=1, return_state=True).is_completed()
    assert receipt_stamp(paths, 2, "generate") == stamps["generate"], "the rollout was reused"
    for task in ("update_actor", "update_critic"):
        assert receipt_stamp(paths, 2, task) != stamps[task], (
            f"{task} ran again: its checkpoint never completed"
        )
    assert_same_commit(base_run["url"], url, 2)


def test_a_fault_after_commit_1_while_iteration_2_writes(base_run, flow_config, tmp_path, monkeypatch):
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp", at=0)
    paths = ExperimentPaths(url)
    cfg = flow_config(str(tmp_path), "exp")
    faults.reset()
    monkeypatch.setenv(faults.ENV_VAR, "task:commit@2:before:always")
    state = ppo(cfg, iterations=2, return_state=True)
    assert state.is_failed() and "commit@2" in str(state.result(raise_on_failure=False))
    assert read_manifest(paths).iteration == 1
    assert_same_commit(base_run["url"], url, 1)
    by_name = task_runs(state)
    assert by_name["generate-2"].start_time < by_name["commit-1"].end_time, (
        "iteration 2 starts while commit 1 waits for its checkpoints"
    )
    monkeypatch.delenv(faults.ENV_VAR)
    faults.reset()
    assert ppo(cfg, iterations=1, return_state=True).is_completed()
    assert_same_commit(base_run["url"], url, 2)


def test_rollback_then_rerun_commits_what_the_original_run_committed(base_run, flow_config, tmp_path, capsys):
    from ppoflow.cli.main import main
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp")
    paths = ExperimentPaths(url)
    assert main(["rollback", url, "--to", "1"]) == 0
    assert "now at iteration 1 (was 2)" in capsys.readouterr().out
    assert read_manifest(paths).iteration == 1
    assert not storage.exists(paths.receipt(2, "generate")), "iteration 2 will be computed again"
    assert ppo(flow_config(str(tmp_path), "exp"), iterations=1, return_state=True).is_completed()
    assert_same_commit(base_run["url"], url, 2)
