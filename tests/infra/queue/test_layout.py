"""ppoflow.infra.queue.layout: every URL of the queue stays inside the experiment, and the
listings read what is on storage."""

from __future__ import annotations

import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.queue.layout import QueuePaths


def test_urls_and_listings(tmp_path):
    q = QueuePaths(str(tmp_path / "exp"))
    assert q.policy(12).endswith("exp/queue/policy/v000012")
    assert q.done(3).endswith("exp/queue/batches/000003/done.json")
    assert q.ref(q.batch(3)) == "queue/batches/000003/batch.arrow" and q.url(q.ref(q.batch(3))) == q.batch(3)
    assert q.versions() == [] and q.batch_numbers() == [] and q.parts(1) == []
    for url in (q.part(1, 1), q.part(1, 0), q.done(2), q.policy(3) + "/x", q.policy(1) + "/x"):
        storage.write_bytes_atomic(url, b"x")
    storage.write_bytes_atomic(q.batch_dir(1) + "/prompts.arrow", b"x")  # not a part
    assert q.versions() == [1, 3] and q.batch_numbers() == [1, 2]
    assert q.parts(1) == [q.part(1, 0), q.part(1, 1)]
    with pytest.raises(ValueError):
        q.url("queue/../../elsewhere")
