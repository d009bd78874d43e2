"""ppoflow.tasks.publish without ranks: when a policy version may be written in the background.
Publishing on a trainer's run (every version the producers load, in the background at s = 1,
synchronously at s = 0, the trainer killed mid-publish): tests/flows/test_asynchronous.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ppoflow.infra.checkpoint.marker import write_failure, write_marker
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.tasks.publish import _previous_is_complete


class _Actor:
    """The actor group's handle as publish uses it: the previous background write is waited for."""

    def __init__(self) -> None:
        self.waits = 0

    def wait_checkpoint(self) -> None:
        self.waits += 1


def _step(staleness: int, n: int) -> SimpleNamespace:
    cfg = SimpleNamespace(asynchronous=SimpleNamespace(max_staleness=staleness))
    return SimpleNamespace(cfg=cfg, n=n, logger=logging.getLogger("test-publish"))


@pytest.fixture
def queue(tmp_path) -> QueuePaths:
    return QueuePaths(str(tmp_path / "exp"))


def test_staleness_zero_never_writes_in_the_background(queue):
    write_marker(queue.policy(2), {"format": "ppoflow-dcp-v2"})
    actor = _Actor()
    assert not _previous_is_complete(_step(0, 3), queue, actor)  # batch 4 needs version 3 itself
    assert actor.waits == 0


def test_a_complete_previous_version_lets_the_next_one_write_in_the_background(queue):
    write_marker(queue.policy(2), {"format": "ppoflow-dcp-v2"})
    actor = _Actor()
    assert _previous_is_complete(_step(1, 3), queue, actor)
    assert actor.waits == 1  # the group's previous write is over before version 2 is looked at


def test_a_lost_or_failed_previous_write_makes_the_next_one_synchronous(queue, caplog):
    actor = _Actor()
    with caplog.at_level(logging.WARNING, logger="test-publish"):
        assert not _previous_is_complete(_step(2, 3), queue, actor)  # version 2 never landed
    assert "policy version 2 was not published (its background write did not finish)" in caplog.text
    assert "version 3 is written before the task returns" in caplog.text
    write_failure(queue.policy(4), ["rank 0: OSError: [Errno 28] No space left on device"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test-publish"):
        assert not _previous_is_complete(_step(1, 5), queue, actor)
    assert "No space left on device" in caplog.text
    assert actor.waits == 2
