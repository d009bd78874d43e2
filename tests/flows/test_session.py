"""ppoflow.flows.session.ExperimentSession, without ranks: what it takes on the way in (the run's
context, the experiment lock, the manifest, the device slots) and that it gives all of it back on
the way out, whether the block ends well, fails, or is interrupted; and what a refused start
leaves behind (nothing). The flows that use it run in tests/flows/ and tests/scenarios/."""

from __future__ import annotations

import logging
import os

import pytest

from ppoflow.flows.session import ExperimentSession, NoTracker
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.lock import ExperimentLock, ExperimentLocked
from ppoflow.infra.experiment.manifest import ExperimentPaths, IdentityMismatch
from ppoflow.tasks.run import get_run
from tests.support.configs import session_config
from tests.support.experiments import commit_tiny_iterations
from tests.support.processes import free_by_flock

LOG = logging.getLogger("test-session")


def _config(tmp_path, model: str = "m"):
    return session_config(tmp_path, model)


@pytest.fixture
def slots(tmp_path, monkeypatch):
    """This test's own device slots: 2 CPU slots in a directory of its own."""
    directory = tmp_path / "slots"
    monkeypatch.setenv("PPOFLOW_SLOTS_DIR", str(directory))
    monkeypatch.setenv("PPOFLOW_DEVICE_SLOTS", "2")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return directory


def _released(paths: ExperimentPaths, slots, key: str) -> None:
    assert not storage.exists(paths.lock)
    assert free_by_flock(slots, "cpu", 2) == [0, 1]
    with pytest.raises(RuntimeError, match="no open ppoflow run"):
        get_run(key)


def test_it_takes_the_lock_manifest_and_slots_and_gives_them_back(tmp_path, slots):
    cfg = _config(tmp_path)
    paths = commit_tiny_iterations(cfg, last=1)
    with ExperimentSession(cfg, LOG, "run-a", preflight=False) as session:
        assert session.manifest is not None and session.manifest.iteration == 1
        assert get_run("run-a") is session.ctx and session.ctx.lock is not None
        assert storage.read_json(paths.lock)["run_id"] == "run-a"
        assert free_by_flock(slots, "cpu", 2) == []  # both held by this run
        assert isinstance(session.tracker, NoTracker)  # tracking is off: one that records nothing
    _released(paths, slots, "run-a")


@pytest.mark.parametrize("error", [RuntimeError("a task failed"), KeyboardInterrupt()])
def test_a_failure_or_an_interrupt_inside_gives_everything_back(tmp_path, slots, error):
    cfg = _config(tmp_path)
    paths = commit_tiny_iterations(cfg, last=1)
    with pytest.raises(type(error)):
        with ExperimentSession(cfg, LOG, "run-b", preflight=False):
            raise error
    _released(paths, slots, "run-b")


def test_a_refused_start_takes_no_slots_and_leaves_no_run(tmp_path, slots):
    """A locked experiment, or a config for other weights, fails at the lock or the manifest:
    before the device slots, and without leaving the run's context or the lock behind."""
    cfg = _config(tmp_path)
    paths = commit_tiny_iterations(cfg, last=1)
    with ExperimentLock(paths.lock, run_id="the-other-run"):
        with pytest.raises(ExperimentLocked):
            ExperimentSession(cfg, LOG, "run-c", preflight=False).__enter__()
        assert storage.read_json(paths.lock)["run_id"] == "the-other-run"
        assert free_by_flock(slots, "cpu", 2) == [0, 1]
    with pytest.raises(IdentityMismatch):
        with ExperimentSession(_config(tmp_path, model="other"), LOG, "run-d", preflight=False):
            pass
    _released(paths, slots, "run-c")
    _released(paths, slots, "run-d")


def test_a_reader_takes_the_slots_but_not_the_lock(tmp_path, slots):
    """The ppo-eval flow's session: device slots and groups, no lock and no manifest, so it runs
    beside training."""
    cfg = _config(tmp_path)
    paths = commit_tiny_iterations(cfg, last=1)
    with ExperimentLock(paths.lock, run_id="training"):
        with ExperimentSession(cfg, LOG, "eval-x", lock=False, preflight=False) as session:
            assert session.manifest is None and session.ctx.lock is None
            assert free_by_flock(slots, "cpu", 2) == []
    _released(paths, slots, "eval-x")


def test_on_gpus_auto_token_budgets_are_planned_before_anything_starts(tmp_path, slots, monkeypatch):
    """With the preflight on, the ``auto`` update budgets become the memory plan's largest that fits
    (``ppoflow.infra.preflight.memory_check``) as the session opens, before the run's context: the
    experiment locked by another run stops the session at the lock, and the budgets are already set;
    a session without the preflight (a reader, a producer) leaves them as they were."""
    from tests.infra.preflight.test_memory_check import config, fake_nvidia_smi
    from tests.infra.preflight.test_model_shape import QWEN_05B

    monkeypatch.setenv(
        "PATH", fake_nvidia_smi(tmp_path, "0, GPU-aaaa, 81559") + os.pathsep + os.environ["PATH"]
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mini = {"actor.ppo_mini_batch_size": 64, "critic.ppo_mini_batch_size": 64}
    cfg, plain = config(tmp_path, QWEN_05B, **mini), config(tmp_path, QWEN_05B, **mini)
    lines: list[str] = []
    logger = logging.getLogger("test-session-budgets")
    monkeypatch.setattr(logger, "info", lines.append)
    with ExperimentLock(ExperimentPaths.of(cfg).lock, run_id="the-other-run"):
        with pytest.raises(ExperimentLocked):
            ExperimentSession(cfg, logger, "run-m").__enter__()
        with pytest.raises(ExperimentLocked):
            ExperimentSession(plain, logger, "run-n", preflight=False).__enter__()
    assert cfg.actor.update_tokens == cfg.critic.update_tokens > 16384 == plain.actor.update_tokens
    assert len(lines) == 1 and f"auto -> {cfg.actor.update_tokens} tokens (was 16384, 16384)" in lines[0]
