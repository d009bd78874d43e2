"""Failing well, in the flow (a real temporary Prefect API, real ranks, vLLM, moto's S3 server).

- a dataset the run cannot use fails in ``preflight``, before any worker group starts;
- deterministic errors fail their task at once: a reward function that returns NaN (in the
  ``advantage`` task), a ``DataError`` raised inside a rank; a dead rank is retried;
- S3 errors while writing a DataProto, a checkpoint and the manifest are retried or fail the task
  cleanly, nothing half-written is published, and the run resumes to commit what an
  uninterrupted run commits.

The flows use a light config (GRPO: no critic, no reward model), one worker group.
"""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.configs import LIGHT, LIGHT_HF
from tests.support.experiments import assert_same_commit
from tests.support.prefect_runs import attempts
from tests.support.processes import descendants

pytestmark = pytest.mark.slow


def rank_processes() -> list[int]:
    """Pids of ppoflow ranks and torchrun launchers running below this process (a forked rank's
    command line is its launcher's)."""
    return [
        pid
        for pid, cmd in descendants(os.getpid()).items()
        if any(k in cmd for k in ("remote.rank.launch", "remote.rank.entry", "torch.distributed.run"))
    ]


@pytest.fixture(autouse=True)
def _fresh_faults(monkeypatch, tmp_path):
    faults.reset()
    monkeypatch.setenv("PPOFLOW_SLOTS_DIR", str(tmp_path / "slots"))
    yield
    faults.reset()


def test_a_dataset_without_prompts_fails_in_preflight_before_any_group(
    prefect_harness, flow_config, flow_assets, tmp_path
):
    from ppoflow.flows.ppo import ppo

    table = pq.read_table(flow_assets["data"]).drop(["prompt"])
    bad = str(tmp_path / "no_prompt.parquet")
    pq.write_table(table, bad)
    cfg = flow_config(str(tmp_path), "exp", **LIGHT, **{"data.train_files": [bad]})
    t0 = time.perf_counter()
    state = ppo(cfg, iterations=1, return_state=True)
    took = time.perf_counter() - t0
    assert state.is_failed()
    msg = str(state.result(raise_on_failure=False))
    assert f"{bad}: missing column(s) ['prompt']" in msg and "Fix: write the rows in veRL's format" in msg
    assert attempts(state) == {"preflight": 1}  # no init, no generate: no worker group ever started
    assert rank_processes() == []
    paths = ExperimentPaths.of(cfg)
    assert read_manifest(paths) is None and not os.path.exists(paths.lock)
    print(f"\nfailed in preflight after {took:.1f} s (a worker group start alone takes longer)")
    assert took < 20


def test_nan_reward_fails_at_once_and_a_dead_rank_is_retried(
    prefect_harness, flow_config, tmp_path, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    cfg = flow_config(
        str(tmp_path),
        "exp",
        **LIGHT_HF,  # transformers generates: the engine has no part in this, and starts in half the time
        **{"reward.custom_function": "tests.support.rewards:nan_past_preflight"},
    )
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:generate_sequences:1")
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    msg = str(state.result(raise_on_failure=False))
    assert "RewardError" in repr(state.result(raise_on_failure=False))
    assert "nan_past_preflight" in msg and "returned a non-finite score (nan)" in msg
    tries = attempts(state)
    assert tries["generate"] == 2  # the dead rank: retried on a rebuilt group
    assert tries["advantage"] == 1  # the NaN: not retried
    assert read_manifest(ExperimentPaths.of(cfg)).iteration == 0


def test_a_deterministic_error_inside_a_rank_is_permanent_a_dead_rank_is_not():
    from ppoflow.infra.data.prompts import DataError
    from ppoflow.infra.remote.driver.group import RankFailure, WorkerGroup
    from ppoflow.tasks.step import is_permanent

    errors = {}
    for kind, call, env in (
        ("data", ("raise_error", 1, "ppoflow.infra.data.prompts:DataError", "row 7 has no prompt"), {}),
        ("value", ("raise_error", 0, "builtins:ValueError", "a bug"), {}),
        ("dead", ("echo",), {"PPOFLOW_FAULT": "rank_exit:echo:1"}),
    ):
        group = WorkerGroup(
            "tests.support.toy_workers:ToyWorker",
            nprocs=2,
            config={},
            log=lambda line: None,
            env=env,
            grace_s=1.0,
        )
        group.start()
        try:
            with pytest.raises(RankFailure) as err:
                group.call(*call)
            errors[kind] = err.value
        finally:
            group.shutdown()
    data = errors["data"]
    assert "DataError: row 7 has no prompt" in str(data)
    assert data.raised(DataError) and "ppoflow.infra.data.prompts.DataError" in data.error_types
    assert is_permanent(data)
    assert errors["value"].error_types[0] == "builtins.ValueError" and not is_permanent(errors["value"])
    assert errors["dead"].error_types == () and not is_permanent(errors["dead"])


# ------------------------------------------------------------------------------------ storage


@pytest.fixture(scope="module")
def s3():
    from tests.support.faulty_s3 import faulty_s3

    with faulty_s3() as server:
        yield server


def listing(url: str) -> dict[str, int]:
    """{key: size} of every object under ``url``, temporary names included."""
    fs, path = storage.url_to_fs(url)
    fs.invalidate_cache()
    return {k: v["size"] for k, v in fs.find(path, detail=True).items()}


def modified(url: str):
    fs, path = storage.url_to_fs(url)
    return fs.info(path, refresh=True)["LastModified"]


def test_storage_faults_are_retried_or_fail_cleanly_and_the_run_resumes(light_run, flow_config, s3):
    """The reference is the local run (``light_run``): on S3 the same iteration is committed."""
    from ppoflow.flows.ppo import ppo
    from tests.support.faulty_s3 import BUCKET

    root = f"s3://{BUCKET}/runs"
    cfg = flow_config(root, "exp", **LIGHT)
    exp = f"/{BUCKET}/runs/exp"
    s3.fail("PUT", rf"^{exp}/iterations/000001/rollout\.arrow$", times=2)  # a DataProto write
    s3.fail("PUT", rf"^{exp}/checkpoints/actor/000001/model/__1_0\.distcp$", times=2)  # rank 1's shard
    s3.fail("PUT", rf"^{exp}/manifest\.json$", times=10_000, skip=1)  # every publish after iteration 0's
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    assert "We encountered an internal error" in str(state.result(raise_on_failure=False))
    tries = attempts(state)
    # the DataProto write fails the task once and Prefect retries it; the shard's two failures are
    # absorbed by the background checkpoint writer's own attempts (checkpoint.write_attempts = 3), so
    # update_actor runs once; the manifest never publishes and commit exhausts its retries
    assert tries["generate"] == 2 and tries["update_actor"] == 1 and tries["commit"] == 3, tries
    failed = [path.rsplit("/", 1)[-1] for _, path in s3.failed]
    assert set(failed) == {"rollout.arrow", "__1_0.distcp", "manifest.json"}
    assert failed.count("__1_0.distcp") == 2
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 0  # the commit point never moved
    keys = listing(cfg.storage.experiment_url)
    assert not [k for k in keys if storage.TEMP_MARKER in k], "a temporary object was left behind"
    assert not storage.exists(paths.lock)
    stamps = {
        name: modified(paths.file(1, name)) for name in ("prompts.arrow", "rollout.arrow", "advantages.arrow")
    }

    s3.clear()
    resumed = ppo(cfg, iterations=1, return_state=True)
    assert resumed.is_completed()
    assert read_manifest(paths).iteration == 1
    again = {name: modified(paths.file(1, name)) for name in stamps}
    assert again == stamps  # resumed at commit: nothing recomputed
    assert_same_commit(light_run, cfg.storage.experiment_url, 1, roles=("actor",))
    table = pa.ipc.open_file(pa.BufferReader(storage.read_bytes(paths.file(1, "rollout.arrow")))).read_all()
    assert table.num_rows == 8
