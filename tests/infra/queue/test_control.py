"""ppoflow.infra.queue.control: the queue made to agree with the committed iteration, retention
after a commit, the stop marker, and what ``ppoflow status`` shows."""

from __future__ import annotations

import torch

from ppoflow.infra.checkpoint.sharded import save_checkpoint
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.queue.batches import ROW, claim_batch, finished_rows, publish_batch, publish_part
from ppoflow.infra.queue.control import queue_status, reconcile, request_stop, retain, stop_requested
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions


def _batch(q: QueuePaths, k: int, version: int, whole: bool = True) -> None:
    part = DataProto.from_dict(
        {
            "token_versions": torch.full((2, 3), version, dtype=torch.int32),
            "response_mask": torch.ones((2, 3)),
            ROW: torch.tensor([0, 1]),
        }
    )
    publish_part(q, k, part)
    if whole:
        publish_batch(q, k, finished_rows(q, k), {"versions": [version, version]})


def test_reconcile_drops_what_no_committed_iteration_produced(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    for v in range(4):
        save_checkpoint(q.policy(v), torch.nn.Linear(2, 2))
    PolicyVersions(q).publish(3)  # updates 2 and 3 ran, iteration 2 never committed
    _batch(q, 1, 0)  # consumed by commit 1
    _batch(q, 2, 1)
    _batch(q, 3, 2)  # sampled by version 2: gone with it
    _batch(q, 4, 3, whole=False)  # a part only, sampled by version 3
    request_stop(q, "the last run ended")
    removed = reconcile(q, committed=1)
    assert removed == {"versions": [2, 3], "batches": [1, 3, 4]}
    assert q.batch_numbers() == [2] and q.versions() == [0, 1]
    assert PolicyVersions(q).latest().version == 1 and stop_requested(q) is None


def test_retention_and_status(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    for v in range(5):
        save_checkpoint(q.policy(v), torch.nn.Linear(2, 2))
    PolicyVersions(q).publish(4)
    for k in (3, 4, 5):
        _batch(q, k, k - 1)
    claim = claim_batch(q, 6, "producer-x", stale_after_s=30)
    _batch(q, 6, 4, whole=False)
    status = queue_status(q, committed=3)
    assert status["latest_version"] == 4 and not status["stopped"]
    states = {row["batch"]: row["state"] for row in status["batches"]}
    assert states == {3: "consumed", 4: "waiting", 5: "waiting", 6: "in flight"}
    assert status["batches"][1]["staleness_max"] == 0 and status["batches"][3]["producer"] == "producer-x"
    assert retain(q, committed=4, keep_versions=2) == [
        "batches/000003",
        "batches/000004",
        "policy/v000000",
        "policy/v000001",
    ]
    assert q.batch_numbers() == [5, 6] and q.versions() == [2, 3, 4]
    claim.release()
