"""ppoflow.cli.queue_status: what ``ppoflow status`` says of an experiment's rollout queue."""

from __future__ import annotations

import torch

from ppoflow.cli.queue_status import print_queue, queue_lines, queue_status_of
from ppoflow.infra.checkpoint.sharded import save_checkpoint
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.queue.batches import ROW, claim_batch, finished_rows, publish_batch, publish_part
from ppoflow.infra.queue.control import request_stop
from ppoflow.infra.queue.layout import QueuePaths
from ppoflow.infra.queue.policy import PolicyVersions


def _part(version: int) -> DataProto:
    return DataProto.from_dict(
        {
            "token_versions": torch.full((2, 3), version, dtype=torch.int32),
            "response_mask": torch.ones((2, 3)),
            ROW: torch.tensor([0, 1]),
        }
    )


def test_no_queue_no_lines_and_each_batch_with_its_state(tmp_path, capsys):
    paths = ExperimentPaths(str(tmp_path / "exp"))
    assert queue_lines(paths, 0) == [] and queue_status_of(paths, 0) is None
    print_queue(paths, 0)
    assert capsys.readouterr().out == ""  # synchronous training: status says nothing of a queue
    q = QueuePaths(paths.root)
    save_checkpoint(q.policy(3), torch.nn.Linear(2, 2))
    PolicyVersions(q).publish(3)
    publish_part(q, 4, _part(2))
    publish_batch(q, 4, finished_rows(q, 4), {"versions": [2, 2]})
    claim = claim_batch(q, 5, "producer-run-x", stale_after_s=30)
    publish_part(q, 5, _part(3))
    request_stop(q, "the trainer's run ended")
    lines = queue_lines(paths, 3)
    print_queue(paths, 3)
    claim.release()
    assert capsys.readouterr().out == "\n".join(lines) + "\n"
    assert lines[1].endswith("newest policy version 3 (producers told to stop)")
    assert lines[2].split() == [
        "batch",
        "4",
        "waiting",
        "2",
        "rows,",
        "versions",
        "[2,",
        "2],",
        "staleness",
        "max",
        "1",
    ]
    assert "in flight" in lines[3] and "1 part(s) published, producer producer-run-x" in lines[3]
    assert queue_status_of(paths, 4)["batches"][0]["state"] == "consumed"
