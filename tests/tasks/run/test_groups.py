"""A flow run's worker groups (``RunGroups``), what can be seen without starting ranks: a closed
run starts no group again, a call to a group that is not running says how to start it, a task
holding a role keeps the other tasks off it until it lets go, the states recorded, and a checkpoint
that no write of this run will complete is refused by name.

Starting, rebuilding and loading groups on real ranks: a rank that dies mid-task and the rebuilt
group that retries it (tests/scenarios/test_flow_resume.py, tests/scenarios/test_failing_flow.py),
a checkpoint lost while written and recomputed from its lineage
(tests/scenarios/test_flow_checkpoints.py), a state rebuilt by replay
(tests/scenarios/test_flow_snapshots.py), a group that cannot start and is not started again
(tests/scenarios/test_failing_early.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from ppoflow.infra.checkpoint.marker import IncompleteCheckpointError
from ppoflow.infra.config import parse_config
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.remote.contracts import ACTOR_ROLE, Build, WorkerMode
from ppoflow.infra.remote.errors import WorkerGroupDead
from ppoflow.tasks.checkpoints import Writes
from ppoflow.tasks.run.groups import DEFAULT_BUILDS, RunClosed, RunGroups
from tests.support.fake_experiments import fake_checkpoint


@pytest.fixture
def groups(tmp_path, caplog):
    """The groups of a run of a small experiment on local files (none started)."""
    cfg = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )
    lines: list[tuple[str, str]] = []
    caplog.set_level(logging.INFO, logger="test-run")
    run = RunGroups(
        "run-1",
        cfg,
        ExperimentPaths.of(cfg),
        Writes(timeout_s=5.0),
        emit=lambda role, line: lines.append((role, line)),
        log=logging.getLogger("test-run"),
        roles={"actor": WorkerMode.ROLLOUT},
    )
    yield run
    run.shutdown()


def test_before_any_group_starts(groups):
    # an evaluation's policy: no optimizer
    assert groups.builds == {**DEFAULT_BUILDS, "actor": Build(WorkerMode.ROLLOUT)}
    assert DEFAULT_BUILDS == {
        "actor": Build(WorkerMode.ACTOR_ROLLOUT_REF),
        "critic": Build(WorkerMode.CRITIC),
        "reward_model": Build(WorkerMode.REWARD_MODEL),
    }
    for role in DEFAULT_BUILDS:
        assert (groups.starts(role), groups.current_group(role), groups.state(role)) == (0, None, None)
    with pytest.raises(
        WorkerGroupDead, match=r"the critic group is not running; call group\('critic'\) first"
    ):
        groups.call("critic", "compute_values", "x.arrow")
    groups.set_state("actor", "ckpt/actor/000003")
    assert groups.state("actor") == "ckpt/actor/000003" and groups.state("critic") is None
    assert groups.take_replays("actor") == {}  # nothing was replayed


@pytest.mark.parametrize("end", ["shutdown", "kill"])
def test_a_closed_run_starts_no_group_again(groups, caplog, end):
    getattr(groups, end)()
    for ask in (lambda: groups.group("actor", None), lambda: groups.worker(ACTOR_ROLE, None)):
        with pytest.raises(RunClosed, match="run run-1 is closed; its worker groups were shut down"):
            ask()
    groups.prestart(["actor", "critic"])  # a start in the background after the end: nothing starts
    for t in [t for t in threading.enumerate() if t.name.startswith("ppoflow-start-")]:
        t.join(timeout=10)
    assert groups.starts("actor") == groups.starts("critic") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # and nothing to say
    getattr(groups, end)()  # again: idempotent


def test_a_task_holding_a_role_keeps_the_others_off_until_it_lets_go(groups):
    took = threading.Event()

    def other_task() -> None:
        with groups.hold("actor"):
            took.set()

    groups.acquire("actor")
    with groups.hold("actor"):  # the holder's own nested use: re-entrant
        pass
    other = threading.Thread(target=other_task)
    other.start()
    assert not took.wait(0.3), "another task took the held actor group"
    with groups.hold("critic"):  # other roles stay free
        pass
    groups.release("actor")
    assert took.wait(5.0)
    other.join()


def test_a_checkpoint_no_write_of_this_run_completes_is_refused(groups, tmp_path):
    done = str(tmp_path / "exp" / "checkpoints" / "actor" / "000001")
    fake_checkpoint(done, seed=1)
    groups.materialize("actor", done)  # complete on storage: nothing to do, no group needed
    missing = str(tmp_path / "exp" / "checkpoints" / "actor" / "000002")
    with pytest.raises(
        IncompleteCheckpointError,
        match=r"000002 is not complete: no write of it finished, and none is running in this flow run",
    ):
        groups.materialize("actor", missing)
    assert groups.starts("actor") == 0


def test_a_mode_the_groups_worker_does_not_build_is_refused_before_any_start(groups, tmp_path):
    with pytest.raises(ValueError, match="the critic group's worker builds one of critic, not 'rollout'"):
        RunGroups(
            "run-2",
            groups.cfg,
            groups.paths,
            Writes(timeout_s=5.0),
            lambda *a: None,
            groups.log,
            {"critic": "rollout"},
        )
    teacher = RunGroups(
        "run-3",
        groups.cfg,
        groups.paths,
        Writes(timeout_s=5.0),
        lambda *a: None,
        groups.log,
        {"actor": "actor_ref+teacher"},
    )
    assert teacher.builds["actor"] == Build(WorkerMode.ACTOR_REF, teacher=True)
