"""ppoflow.infra.queue.policy: the pointer to the newest policy version moves forward only, names
complete weights only, survives racing publishers, and old versions go."""

from __future__ import annotations

import threading

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import save_checkpoint
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions, QueueStopped


def _write(q: QueuePaths, *versions: int) -> None:
    for v in versions:
        save_checkpoint(q.policy(v), torch.nn.Linear(2, 2))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_publish_moves_forward_only_and_names_complete_weights(tmp_path, where):
    root = str(tmp_path / "exp") if where == "local" else f"memory://policy-{tmp_path.name}/exp"
    q = QueuePaths(root)
    versions = PolicyVersions(q)
    assert versions.latest() is None
    with pytest.raises(FileNotFoundError, match="not complete"):
        versions.publish(0)
    _write(q, 0, 1, 2)
    assert versions.publish(1) and versions.pointed().version == 1
    assert not versions.publish(0) and versions.pointed().version == 1  # never back
    assert versions.publish(2) and versions.pointed().url == q.policy(2)
    versions.reset(1)  # a rollback to iteration 1: version 2 goes
    assert q.versions() == [0, 1] and versions.latest().version == 1


def test_racing_publishers_leave_the_newest(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    _write(q, *range(8))
    versions = PolicyVersions(q)
    threads = [threading.Thread(target=versions.publish, args=(v,)) for v in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert versions.pointed().version == 7


def test_wait_admits_once_the_version_is_there_and_retention_keeps_the_newest(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    versions = PolicyVersions(q)
    with pytest.raises(QueueStopped):
        versions.wait(0, poll_s=0.01, stopped=lambda: True)
    with pytest.raises(TimeoutError, match="names none"):
        versions.wait(0, poll_s=0.01, timeout_s=0.05)
    threading.Timer(0.1, _write, args=(q, 0, 1, 2, 3)).start()
    assert versions.wait(2, poll_s=0.01, timeout_s=10).version >= 2
    _write(q, 4)
    versions.publish(4)
    assert versions.retain(keep=2) == [0, 1] and q.versions() == [2, 3, 4]


def test_a_complete_version_counts_before_the_pointer_reaches_it(tmp_path):
    """A trainer killed between a version's marker and the pointer's move (the ``publish`` drill):
    producers load that version already, ``settle`` moves the pointer to it, and a version without
    its marker is never named."""
    q = QueuePaths(str(tmp_path / "exp"))
    _write(q, 0, 1, 2)
    versions = PolicyVersions(q)
    versions.publish(0)
    (tmp_path / "exp" / "queue" / "policy" / "v000003").mkdir()  # a write in progress: no marker
    assert q.versions() == [0, 1, 2, 3]
    assert versions.pointed().version == 0
    assert versions.latest().version == 2 and versions.latest().url == q.policy(2)
    assert versions.settle().version == 2 and versions.pointed().version == 2
    assert versions.retain(keep=1) == [0] and versions.latest().version == 2
