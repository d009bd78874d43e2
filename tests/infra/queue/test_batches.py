"""ppoflow.infra.queue.batches: one producer per batch (leases, takeover of a dead one), parts that
survive a producer, the whole batch in row order with a record published last and once, and a
damaged file refused."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.queue.batches import (
    ROW,
    claim_batch,
    finished_rows,
    load_batch,
    publish_batch,
    publish_part,
    read_record,
    wait_record,
)
from ppoflow.infra.queue.layout import QueuePaths
from tests.support.paths import ROOT


def _rows(index: list[int]) -> DataProto:
    return DataProto.from_dict(
        {"responses": torch.tensor([[i, i + 1] for i in index]), ROW: torch.tensor(index)},
        {"uid": np.asarray([f"p{i}" for i in index], dtype=object)},
        meta_info={"temperature": 1.0},
    )


def test_one_live_producer_per_batch_and_a_dead_ones_lease_is_taken_over(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    first = claim_batch(q, 3, "producer-a", stale_after_s=30)
    assert first is not None and claim_batch(q, 3, "producer-b", stale_after_s=30) is None
    first.release()
    code = (
        "import os, sys; from ppoflow.infra.queue.batches import claim_batch; "
        "from ppoflow.infra.queue.layout import QueuePaths; "
        "claim_batch(QueuePaths(sys.argv[1]), 4, 'dead-producer', 30); os._exit(0)"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-c", code, q.experiment], check=True, env=env, cwd=ROOT)
    taken = claim_batch(q, 4, "producer-b", stale_after_s=30)  # its pid is gone: taken at once
    assert taken is not None
    taken.release()


def test_a_batch_claim_holds_a_lease_and_is_no_experiment_lock(tmp_path):
    """A claim is not an experiment lock (nothing that takes a lock accepts it), and a lost claim
    says what it was: its lease's messages name the batch's claim."""
    from ppoflow.infra.experiment.lock import ExperimentLock, Lease

    q = QueuePaths(str(tmp_path / "exp"))
    claim = claim_batch(q, 5, "producer-a", stale_after_s=30)
    assert claim is not None
    assert not isinstance(claim, ExperimentLock) and isinstance(claim.lease, Lease)
    storage.rm(q.claim(5))  # the claim's record vanishes: this producer no longer holds it
    claim.lease.heartbeat()
    with pytest.raises(Exception, match="claim on a rollout batch"):
        claim.check()
    claim.release()


def test_parts_then_the_whole_batch_in_row_order_and_its_record_once(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    assert finished_rows(q, 1) is None
    publish_part(q, 1, _rows([3, 1]))
    publish_part(q, 1, _rows([0]))
    have = finished_rows(q, 1)
    assert have.batch[ROW].tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="not each of"):
        publish_batch(q, 1, have, {})
    publish_part(q, 1, _rows([2]))
    record = publish_batch(q, 1, finished_rows(q, 1), {"versions": [0, 0]})
    again = publish_batch(q, 1, finished_rows(q, 1), {"versions": [9, 9]})  # a second producer
    assert again == record == read_record(q, 1) and record["rows"] == 4
    batch, url = load_batch(q, 1, record)
    assert batch.batch["responses"][:, 0].tolist() == [0, 1, 2, 3] and ROW not in batch.batch
    assert batch.non_tensor_batch["uid"].tolist() == ["p0", "p1", "p2", "p3"]
    assert [n for n in storage.listdir(q.batch_dir(1)) if n.startswith("batch-")] == [record["file"]]
    with open(url, "r+b") as f:  # one flipped byte
        f.seek(record["bytes"] // 2)
        byte = f.read(1)
        f.seek(record["bytes"] // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(OSError, match="damaged"):
        load_batch(q, 1, record)


def test_the_wait_for_a_batch_ends_with_it_or_says_who_holds_it(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    claim = claim_batch(q, 2, "slow-producer", stale_after_s=30)
    with pytest.raises(TimeoutError, match="held by slow-producer"):
        wait_record(q, 2, poll_s=0.01, timeout_s=0.05)

    def lost() -> None:
        raise RuntimeError("the trainer lost its lock")

    with pytest.raises(RuntimeError, match="lost its lock"):
        wait_record(q, 2, poll_s=0.01, timeout_s=5, check=lost)
    publish_part(q, 2, _rows([0]))
    publish_batch(q, 2, finished_rows(q, 2), {})
    assert wait_record(q, 2, poll_s=0.01, timeout_s=1)["rows"] == 1
    claim.release()
