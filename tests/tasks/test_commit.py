"""ppoflow.tasks.commit: an iteration's metrics — every task's, their wall times, the critical path
as the table of steps' stages (the slowest step of a stage counts), the overhead and throughput."""

from __future__ import annotations

import pytest

from ppoflow.tasks.commit import iteration_metrics
from ppoflow.tasks.receipts import Receipt


def test_the_critical_path_takes_the_slowest_step_of_each_stage():
    times = {
        "generate": 3.0,
        "ref_log_prob": 1.0,
        "values": 1.5,
        "rm_score": 0.5,
        "advantage": 0.2,
        "update_actor": 2.0,
        "update_critic": 2.5,
        "commit": 0.3,
    }
    receipts = [Receipt(task=t, iteration=4, timing_s=s, metrics={f"m/{t}": 1.0}) for t, s in times.items()]
    metrics = iteration_metrics(receipts, wall_s=9.0, nprocs=2)
    assert metrics["timing_s/critical_path"] == pytest.approx(3.0 + 1.5 + 0.2 + 2.5 + 0.3)
    assert metrics["timing_s/overhead"] == pytest.approx(9.0 - 7.5)
    assert metrics["timing_s/iteration"] == 9.0
    assert all(metrics[f"timing_s/{t}"] == s for t, s in times.items())
    assert all(metrics[f"m/{t}"] == 1.0 for t in times)
    # a faster wall time than the path (clock skew) never gives a negative overhead
    assert iteration_metrics(receipts, wall_s=1.0, nprocs=2)["timing_s/overhead"] == 0.0
