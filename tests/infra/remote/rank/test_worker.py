"""The Worker base class outside torch.distributed: rank and world from the launcher's
environment, one data-parallel replica per rank, every rank an output rank."""

from __future__ import annotations

import torch

from ppoflow.infra.remote.rank.worker import Worker


def test_a_worker_reads_its_place_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("PPOFLOW_DEVICE", "cpu")
    w = Worker({"a": 1})
    assert (w.rank, w.world_size, w.local_rank, w.device) == (3, 4, 1, torch.device("cpu"))
    assert (w.dp_rank, w.dp_size, w.is_output_rank) == (3, 4, True) and w.config == {"a": 1}
    assert repr(w) == "Worker(rank=3/4, dp=3/4, device=cpu)"
