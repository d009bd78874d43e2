"""How a flow run makes its worker groups (``GroupMaker``), without starting them: each role's
worker class by import path, built as its role, on the run's ranks and device, with the run's
fault drills, threads per rank and deterministic kernels in the ranks' environment, their output
to the run's emitter; how long a start waits for its ranks. Groups started from it on ranks:
tests/scenarios/ (every flow run), across nodes tests/scenarios/test_flow_multinode.py."""

from __future__ import annotations

from ppoflow.infra.config import parse_config
from ppoflow.infra.config.system import DETERMINISTIC_ENV
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.remote.procs import PRELOAD_ENV
from ppoflow.infra.runtime import faults
from ppoflow.tasks.run.making import WORKERS, GroupMaker, connect_timeout_s


def _config(tmp_path, **resources):
    return parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
            "resources": resources,
        }
    )


def test_a_start_waits_for_its_ranks_at_least_as_long_as_the_nodes_join():
    cfg = parse_config({"model": {"path": "m"}, "data": {"train_files": ["t.parquet"]}})
    assert connect_timeout_s(cfg) == cfg.resources.connect_timeout_s == 120.0
    nodes = {"launch": "rendezvous", "rendezvous": {"nnodes": 2, "join_timeout_s": 300.0}}
    shared = {"root": "s3://bucket/runs", "experiment": "exp"}  # every node reads it
    data = {
        "model": {"path": "m"},
        "data": {"train_files": ["t.parquet"]},
        "storage": shared,
        "resources": nodes,
    }
    assert connect_timeout_s(parse_config(data)) == 300.0
    data["resources"] = {**nodes, "connect_timeout_s": 600.0}
    assert connect_timeout_s(parse_config(data)) == 600.0


def test_a_group_is_its_role_s_worker_on_the_run_s_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:update_critic:1,task:commit:before")
    faults.reset()
    cfg = _config(tmp_path, nprocs=4, threads_per_rank=2, deterministic=True, connect_timeout_s=45.0)
    emitted: list[tuple[str, str]] = []
    maker = GroupMaker(
        "run-1", cfg, ExperimentPaths.of(cfg), lambda role, line: emitted.append((role, line)), None
    )
    group = maker.group("critic", "critic", 1)
    try:
        assert (group.worker, group.nprocs, group.device) == (WORKERS["critic"], 4, "cpu")
        assert group.config == {"config": cfg.model_dump(mode="json"), "role": "critic"}
        assert group.start_timeout_s == 45.0 and group.pids == []  # made, not started
        # the ranks get the rank drills only (a task's drill fires in the flow's process)
        assert group.env == {
            faults.ENV_VAR: "rank_exit:update_critic:1",
            "PPOFLOW_RANK_THREADS": "2",
            **DETERMINISTIC_ENV,
        }
        group.log("a rank's line")
        assert emitted == [("critic", "a rank's line")]
    finally:
        group.shutdown()
        maker.close()  # no cluster hub was opened: nothing to close
    plain = GroupMaker("run-2", _config(tmp_path), ExperimentPaths.of(cfg), lambda role, line: None, None)
    group = plain.group("actor", "rollout", 2)
    try:
        assert group.worker == WORKERS["actor"] and group.config["role"] == "rollout"
        # a group that builds the rollout engine has its launcher import the engine's modules
        assert group.env == {faults.ENV_VAR: "rank_exit:update_critic:1", PRELOAD_ENV: "vllm.entrypoints.llm"}
    finally:
        group.shutdown()
