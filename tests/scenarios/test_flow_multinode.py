"""The ``ppo`` flow on two "nodes": two ``ppoflow agent`` processes started with ``--nnodes 2``
dial this process's control endpoint on 127.0.0.1; every worker group (actor, critic, reward
model) runs one gloo rank under each agent, meeting in a c10d rendezvous; the experiment lives on
S3 (moto). Against the uninterrupted local 2-rank ``base_run``:

1. two iterations commit bit for bit what the local group committed (checkpoints, per-rank RNG
   states, metrics, data cursor, KL coefficient);
2. a copy rolled back to iteration 1 runs iteration 2 while the node hosting rank 1 is lost in
   ``update_actor`` (``node_exit`` drill: the rank SIGKILLs its agent). The task fails within
   seconds naming the lost node; a new agent for that node starts (what Slurm or Kubernetes
   would do); Prefect's retry rebuilds the groups on both nodes from checkpoint 1 and commits what
   the uninterrupted run committed. No process of either agent is left behind.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit
from tests.support.nodes import KEY, Agents
from tests.support.ports import free_port
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes(s3_server, tmp_path_factory):
    """Two agents (``--nnodes 2``) for a driver on fixed free ports; the cluster key in this
    process's environment too (the flow's driver reads it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PPOFLOW_CLUSTER_KEY", KEY)
    mp.delenv("PPOFLOW_CLUSTER_KEY_FILE", raising=False)
    control, rdzv = free_port(), free_port()
    agents = Agents(f"127.0.0.1:{control}", tmp_path_factory.mktemp("flow-agents"))
    for node in (0, 1):
        agents.start(node, "--nnodes", "2")
    yield {"agents": agents, "control_port": control, "rdzv_port": rdzv}
    agents.stop_all()
    mp.undo()
    assert agents.wait_no_descendants() == []


def two_node_config(flow_config, nodes, root: str):
    return flow_config(
        root,
        "exp",
        **{
            "resources.launch": "rendezvous",
            "resources.rendezvous": {
                "nnodes": 2,
                "nproc_per_node": 1,
                "driver_host": "127.0.0.1",
                "bind_host": "127.0.0.1",
                "control_port": nodes["control_port"],
                "rdzv_port": nodes["rdzv_port"],
                "join_timeout_s": 120,
            },
        },
    )


@pytest.fixture(scope="module")
def two_node_run(base_run, flow_config, nodes, s3_server):
    from ppoflow.flows.ppo import ppo

    cfg = two_node_config(flow_config, nodes, f"{s3_server['url']}/two-nodes")
    t0 = time.perf_counter()
    state = ppo(cfg, iterations=2, return_state=True)
    print(
        f"\n[timing] 2 iterations on 2 nodes {time.perf_counter() - t0:.1f} s (local: {base_run['wall_s']:.1f} s)"
    )
    return {"cfg": cfg, "url": cfg.storage.experiment_url, "state": state}


def copy_rolled_back(src_url: str, dst_url: str, at: int) -> None:
    """Copy an experiment on S3 and roll the copy back to manifest ``at``."""
    fs, src = storage.url_to_fs(src_url)
    _, dst = storage.url_to_fs(dst_url)
    fs.copy(src, dst, recursive=True)
    for sub in ("iterations", "checkpoints/actor", "checkpoints/critic"):
        for entry in storage.listdir(storage.join(dst_url, sub)):
            if int(entry) > at:
                storage.rm(storage.join(dst_url, sub, entry), recursive=True)
    manifest = storage.read_bytes(storage.join(dst_url, "iterations", f"{at:06d}", "manifest.json"))
    storage.write_bytes_atomic(storage.join(dst_url, "manifest.json"), manifest)


def rng_diff(url_a: str, url_b: str, n: int) -> list[str]:
    from tests.support.experiments import rng_states

    out = []
    for role in ("actor", "critic"):
        a = rng_states(ExperimentPaths(url_a).checkpoint(role, n))
        b = rng_states(ExperimentPaths(url_b).checkpoint(role, n))
        for name in sorted(set(a) | set(b)):
            for part in sorted(set(a.get(name, {})) | set(b.get(name, {}))):
                if a.get(name, {}).get(part) != b.get(name, {}).get(part):
                    out.append(f"{role}/{name}/{part}")
    return out


class TaskLog(logging.Handler):
    """Keeps Prefect's task-run log records (their text and when they were made)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.created, record.getMessage()))


def test_two_nodes_commit_what_a_local_two_rank_group_commits(two_node_run, base_run, nodes):
    assert two_node_run["state"].is_completed(), two_node_run["state"]
    url = two_node_run["url"]
    assert read_manifest(ExperimentPaths(url)).iteration == 2
    for n in (0, 1, 2):
        print(f"\n[rng] iteration {n}: differing RNG parts: {rng_diff(base_run['url'], url, n)}")
    for n in (1, 2):
        assert_same_commit(base_run["url"], url, n)
    agents = nodes["agents"]
    for node in (0, 1):  # every group ran a rank on each node and ended cleanly there
        log = agents.log(node)
        for role in ("actor", "critic", "rewardmodel"):
            assert f"-{role}-1: torchrun pid" in log, log[-3000:]
            assert f"-{role}-1 ended (status 0)" in log, log[-3000:]
    assert not storage.exists(storage.join(url, "scratch")) or not storage.listdir(
        storage.join(url, "scratch")
    )
    assert agents.wait_no_descendants() == []


def test_a_lost_node_fails_update_actor_fast_and_the_retry_commits_the_same(
    two_node_run, base_run, flow_config, nodes, s3_server, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    root = f"{s3_server['url']}/lost-node"
    copy_rolled_back(two_node_run["url"], f"{root}/exp", at=1)
    cfg = two_node_config(flow_config, nodes, root)
    agents: Agents = nodes["agents"]
    deaths: list[tuple[int, float]] = []
    stop = threading.Event()

    def supervisor() -> None:  # restarts a dead agent, as Slurm/Kubernetes would
        while not stop.is_set():
            for node, proc in list(agents.procs.items()):
                if proc.poll() is not None:
                    deaths.append((node, time.time()))
                    agents.start(node, "--nnodes", "2")
            time.sleep(0.02)

    watcher = threading.Thread(target=supervisor, daemon=True)
    task_log = TaskLog()
    logging.getLogger("prefect.task_runs").addHandler(task_log)
    monkeypatch.setenv(faults.ENV_VAR, "node_exit:update_actor:1")
    faults.reset()
    watcher.start()
    try:
        state = ppo(cfg, iterations=1, return_state=True)
    finally:
        stop.set()
        watcher.join()
        logging.getLogger("prefect.task_runs").removeHandler(task_log)
    assert state.is_completed(), state
    assert len(deaths) == 1, deaths
    node, died_at = deaths[0]
    lost = [(t, m) for t, m in task_log.records if "was lost" in m and "update_actor" in m]
    assert lost, [m[:300] for _, m in task_log.records]
    failed_at, message = lost[0]
    print(f"\n[timing] update_actor failed {failed_at - died_at:.2f} s after node {node}'s agent died")
    assert failed_at - died_at < 10.0
    assert f"node {node} (host " in message and "Retry 1/2" in message
    assert attempts(state)["update_actor"] == 2
    assert_same_commit(base_run["url"], f"{root}/exp", 2)
    assert agents.wait_no_descendants() == []
