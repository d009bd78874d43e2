"""Retries, resume and the experiment lock, against the uninterrupted ``base_run``.

One scenario, on a copy of the base experiment rolled back to manifest 1 (iteration 2 never
happened), so iteration 2 runs cold (fresh groups loading checkpoint 1) and must still equal the
base run's warm iteration 2 bit for bit:

1. a flow run with a fault in every task of the iteration (each fails once and is retried by
   Prefect; in ``update_actor`` a rank dies, so the actor group is rebuilt from checkpoint 1 and
   updates again), and ``update_critic`` failing every time: the flow run fails, nothing is
   committed;
2. the flow run again (what ``prefect flow-run retry`` or the UI's button do), with ``commit``
   failing once after publishing: it resumes at ``update_critic`` (no rollout is recomputed) and
   commits iteration 2 — equal to the base run's. While it runs, a second run of the same
   experiment is refused by the experiment lock and changes nothing.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from ppoflow.infra.checkpoint.sharded import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit, copy_experiment
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow

FIRST_RUN_FAULTS = (
    "task:generate:after",
    "task:ref_log_prob:before",
    "task:values:after",
    "task:rm_score:before",
    "task:advantage:after",
    "rank_exit:update_actor:1",
    "task:update_actor:after",
    "task:update_critic:before:always",
)
DONE_IN_FIRST_RUN = ("generate", "ref_log_prob", "values", "rm_score", "advantage", "update_actor")


def test_faults_retries_resume_and_a_refused_concurrent_run(base_run, flow_config, tmp_path, monkeypatch):
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp", at=1)
    paths = ExperimentPaths(url)
    cfg = flow_config(str(tmp_path), "exp")
    faults.reset()

    # 1. every task fails once (one of them by a killed rank); update_critic never passes
    monkeypatch.setenv(faults.ENV_VAR, ",".join(FIRST_RUN_FAULTS))
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    assert "task 'update_critic' fails before" in str(state.result(raise_on_failure=False))
    assert attempts(state) == {
        "preflight": 1,
        "generate": 2,
        "ref_log_prob": 2,
        "values": 2,
        "rm_score": 2,
        "advantage": 2,
        "update_actor": 3,
        "update_critic": 3,
    }
    assert read_manifest(paths).iteration == 1  # nothing committed
    for task in DONE_IN_FIRST_RUN:
        assert storage.exists(paths.receipt(2, task))
    assert not storage.exists(paths.receipt(2, "update_critic"))
    assert is_complete(paths.checkpoint("actor", 2)) and not is_complete(paths.checkpoint("critic", 2))
    assert not os.path.exists(paths.lock)
    # the updates' mini-batch shuffle is seeded from this, so a retried update shuffles alike
    assert DataProto.load(paths.file(2, "advantages.arrow"), columns=[]).meta_info["iteration"] == 2
    stamps = {
        name: os.stat(paths.file(2, name)).st_mtime_ns for name in ("rollout.arrow", "advantages.arrow")
    }

    # 2. run again: resumes at update_critic; a second run meanwhile is refused
    monkeypatch.setenv(faults.ENV_VAR, "task:commit:after")
    resumed: dict = {}
    thread = threading.Thread(target=lambda: resumed.update(state=ppo(cfg, 1, return_state=True)))
    thread.start()
    deadline = time.time() + 60
    while not os.path.exists(paths.lock) and time.time() < deadline:
        time.sleep(0.02)
    refused = ppo(cfg, iterations=1, return_state=True)
    thread.join()
    assert refused.is_failed() and "held by flow run" in str(refused.result(raise_on_failure=False))
    assert attempts(refused) == {}  # refused before any task ran
    assert resumed["state"].is_completed()
    assert attempts(resumed["state"])["commit"] == 2
    assert {name: os.stat(paths.file(2, name)).st_mtime_ns for name in stamps} == stamps
    assert read_manifest(paths).iteration == 2
    assert_same_commit(base_run["url"], url, 2)
