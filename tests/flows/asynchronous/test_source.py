"""ppoflow.flows.asynchronous.source without ranks: the one place that picks a run's rollout
source, and the queue's source through a run (``producer.start: external``: the trainer starts
no process): its start makes the queue agree with the committed state, ``after_commit`` removes
the consumed batches, ``stop`` writes the marker; and the session holds it (started as it opens
from the committed iteration, stopped first as it closes, told whether the run failed). The
producer the trainer starts itself: tests/flows/test_asynchronous.py."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from ppoflow.flows.asynchronous import QueueSource, memory_advice, rollout_source
from ppoflow.flows.session import TEARDOWN, ExperimentSession
from ppoflow.infra.checkpoint.sharded import save_checkpoint
from ppoflow.infra.queue.control import request_stop, stop_requested
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions
from ppoflow.tasks.run import SYNCHRONOUS, get_run
from tests.infra.queue.test_control import _batch
from tests.support.configs import session_config
from tests.support.experiments import commit_tiny_iterations
from tests.support.processes import free_by_flock

LOG = logging.getLogger("test-source")


def _config(tmp_path, enable: bool = True):
    return session_config(
        tmp_path, **{"asynchronous.enable": enable, "asynchronous.producer.start": "external"}
    )


def test_one_place_picks_the_source_and_the_advice_follows_it(tmp_path):
    cfg = _config(tmp_path)
    assert isinstance(rollout_source(cfg, 3, LOG.info), QueueSource)
    assert rollout_source(cfg, 0, LOG.info) is SYNCHRONOUS  # nothing to train: no queue work
    assert rollout_source(_config(tmp_path, enable=False), 3, LOG.info) is SYNCHRONOUS
    assert "the producer's engine stays awake" in memory_advice(cfg)
    assert memory_advice(_config(tmp_path, enable=False)) == ""


def test_the_queue_source_reconciles_retains_and_stops(tmp_path):
    cfg = _config(tmp_path)
    q = QueuePaths(cfg.storage.experiment_url)
    for v in range(3):
        save_checkpoint(q.policy(v), torch.nn.Linear(2, 2))
    PolicyVersions(q).publish(2)  # update 2 never committed
    for k, v in ((1, 0), (2, 1), (3, 2)):
        _batch(q, k, v)
    request_stop(q, "the last run ended")
    lines: list[str] = []
    source = QueueSource(cfg, 2, lines.append)
    source.stop(failed=False)  # never started: nothing to stop
    assert stop_requested(q) is not None and stop_requested(q)["after"] is None
    source.start(1)
    assert source.producer is None  # an external producer: the trainer starts none
    assert q.batch_numbers() == [2] and q.versions() == [0, 1] and stop_requested(q) is None
    assert lines == [
        "rollout queue: removed policy versions [2] and batches [1, 3] (beyond committed iteration 1)"
    ]
    source.check()
    assert source.after_commit(2) == ["queue/batches/000002"]
    source.stop(failed=True)
    assert stop_requested(q)["after"] == 3  # committed + iterations


class _Recording:
    """A rollout source that notes what the session asks of it, and what holds at its stop."""

    def __init__(self, key: str, slots):
        self.key, self.slots, self.calls = key, slots, []

    def start(self, committed: int) -> None:
        self.calls.append(("start", committed))

    def check(self) -> None:
        pass

    def after_commit(self, n: int) -> list[str]:
        return []

    def stop(self, failed: bool) -> None:
        # stopped first: the run still open and its device slots still held
        self.calls.append(
            ("stop", failed, get_run(self.key) is not None, free_by_flock(self.slots, "cpu", 2))
        )


@pytest.mark.parametrize("error", [None, RuntimeError("a task failed")])
def test_the_session_starts_its_source_last_and_stops_it_first(tmp_path, monkeypatch, error):
    slots = tmp_path / "slots"
    monkeypatch.setenv("PPOFLOW_SLOTS_DIR", str(slots))
    monkeypatch.setenv("PPOFLOW_DEVICE_SLOTS", "2")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = _config(tmp_path)
    commit_tiny_iterations(cfg, last=1)
    source = _Recording("run-q", slots)
    assert TEARDOWN[0] == "rollouts"
    with pytest.raises(RuntimeError) if error else contextlib.nullcontext():
        with ExperimentSession(cfg, LOG, "run-q", preflight=False, rollouts=source) as session:
            assert session.ctx.rollouts is source and source.calls == [("start", 1)]
            if error:
                raise error
    assert source.calls == [("start", 1), ("stop", error is not None, True, [])]
    assert free_by_flock(slots, "cpu", 2) == [0, 1]
