"""ppoflow.infra.runtime.faults: PPOFLOW_FAULT entries for tasks, ranks and points inside a rank, once or always."""

from __future__ import annotations

import pytest

from ppoflow.infra.runtime import faults


@pytest.fixture(autouse=True)
def _fresh_faults():
    faults.reset()
    yield
    faults.reset()


def test_task_entries_can_name_an_iteration(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "task:commit@2:before:always")
    faults.maybe_fail("commit", "before", 1)
    faults.maybe_fail("commit", "before")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected, match="commit@2"):
            faults.maybe_fail("commit", "before", 2)
    for bad in ("task:commit@:before", "task:commit@x:before", "task:@2:before"):
        with pytest.raises(ValueError, match="bad entry"):
            faults.parse(bad)


def test_rank_points_fire_on_their_rank_once_or_always(monkeypatch):
    spec = "rank_raise:checkpoint_write:1,rank_raise:checkpoint_write:0:always"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    assert faults.rank_entries() == {
        ("rank_raise", "checkpoint_write", 1),
        ("rank_raise", "checkpoint_write", 0),
    }
    monkeypatch.setenv(faults.ENV_VAR, spec)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(faults.FaultInjected, match="checkpoint_write on rank 1"):
        faults.rank_point(faults.CHECKPOINT_WRITE)
    faults.rank_point(faults.CHECKPOINT_WRITE)  # once
    faults.rank_point("some_other_point")
    monkeypatch.setenv("RANK", "0")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected, match="rank 0"):
            faults.rank_point(faults.CHECKPOINT_WRITE)


def test_fault_entries_fire_once_or_always(monkeypatch):
    monkeypatch.setenv(
        faults.ENV_VAR,
        "task:advantage:before, task:commit:after:always,"
        "rank_exit:update_actor:1,rank_raise:compute_values:0:always",
    )
    with pytest.raises(faults.FaultInjected, match="advantage"):
        faults.maybe_fail("advantage", "before")
    faults.maybe_fail("advantage", "before")  # fired once: the retry passes
    faults.maybe_fail("advantage", "after")
    for _ in range(2):
        with pytest.raises(faults.FaultInjected):
            faults.maybe_fail("commit", "after")
    # the ranks get only rank entries (':always' kept for points inside methods, see rank_point)
    assert faults.rank_fault_env() == {
        faults.ENV_VAR: "rank_exit:update_actor:1,rank_raise:compute_values:0:always"
    }
    faults.note_rank_failure("update_actor")
    faults.note_rank_failure("compute_values")
    assert faults.rank_fault_env() == {faults.ENV_VAR: "rank_raise:compute_values:0:always"}
    monkeypatch.delenv(faults.ENV_VAR)
    assert faults.rank_fault_env() == {faults.ENV_VAR: ""}  # never inherit task entries


@pytest.mark.parametrize("bad", ["task:generate:during", "rank_exit:update_actor:x", "boom", "task:x"])
def test_bad_fault_entries_name_the_allowed_forms(monkeypatch, bad):
    monkeypatch.setenv(faults.ENV_VAR, bad)
    with pytest.raises(ValueError, match="allowed: task:<task>:before|after"):
        faults.maybe_fail("generate", "before")


def test_rank_skip_entries_skip_a_point_once_or_always_and_never_raise(monkeypatch):
    spec = "rank_skip:weight_push:0,rank_skip:weight_push:1:always"
    monkeypatch.setenv(faults.ENV_VAR, spec)
    assert faults.rank_fault_env() == {faults.ENV_VAR: spec}  # they reach the ranks
    monkeypatch.setenv("RANK", "0")
    faults.rank_point(faults.WEIGHT_PUSH)  # a skip is not a failure
    assert faults.rank_skips(faults.WEIGHT_PUSH) is True
    assert faults.rank_skips(faults.WEIGHT_PUSH) is False  # once
    assert faults.rank_skips("another_point") is False
    monkeypatch.setenv("RANK", "1")
    assert all(faults.rank_skips(faults.WEIGHT_PUSH) for _ in range(3))  # always
    monkeypatch.setenv("RANK", "2")
    assert faults.rank_skips(faults.WEIGHT_PUSH) is False
    with pytest.raises(ValueError, match="rank_skip:<point>:<rank>"):
        faults.parse("rank_skip:weight_push:x")


def test_kill_entries_kill_the_process_at_their_point_and_are_left_out_when_it_starts_again(monkeypatch):
    import os
    import signal
    import subprocess
    import sys

    from tests.support.paths import ROOT

    code = (
        "from ppoflow.infra.runtime import faults; faults.maybe_kill('publish', 1); print('alive after 1'); "
        "faults.maybe_kill('publish', 2); print('alive after 2')"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, faults.ENV_VAR: "kill:publish:2,task:commit:before"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL and done.stdout.strip() == "alive after 1"
    assert faults.without_kills(env[faults.ENV_VAR]) == "task:commit:before"
    monkeypatch.setenv(faults.ENV_VAR, "kill:policy_load:3,rank_exit:update_actor:1")
    assert faults.rank_fault_env() == {faults.ENV_VAR: "rank_exit:update_actor:1"}  # never to ranks
