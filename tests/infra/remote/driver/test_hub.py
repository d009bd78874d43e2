"""Multi-node pieces without ranks: the cluster key, the config's checks, the driver's endpoint
refusing strangers and misconfigured agents, the torchrun line an agent runs."""

from __future__ import annotations

import os
import time

import pytest

from ppoflow.infra import faults
from ppoflow.infra.config import ConfigError, ExperimentConfig, parse_config
from ppoflow.infra.remote.agent.node_agent import node_rank_from_env
from ppoflow.infra.remote.cluster_key import ClusterKeyError, load_cluster_key
from ppoflow.infra.remote.driver.hub import ClusterHub, NodesMissing
from ppoflow.infra.remote.links import connect
from ppoflow.infra.remote.procs import rendezvous_torchrun_command
from ppoflow.infra.remote.protocol import PROTOCOL, AgentHello, Refused, Welcome, receive, send

KEY = "k" * 40

BASE = {
    "model": {"path": "some/model"},
    "data": {"train_files": ["train.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 2},
    "critic": {"ppo_mini_batch_size": 2},
}


# ---------------------------------------------------------------------- the key
def test_cluster_key_from_a_private_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o600)
    assert load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(path)}) == KEY.encode()
    assert load_cluster_key({"PPOFLOW_CLUSTER_KEY": f" {KEY} "}) == KEY.encode()


def test_cluster_key_problems_name_the_fix(tmp_path):
    with pytest.raises(ClusterKeyError, match="neither PPOFLOW_CLUSTER_KEY_FILE nor PPOFLOW_CLUSTER_KEY"):
        load_cluster_key({})
    path = tmp_path / "key"
    path.write_text(KEY)
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match=f"chmod 600 {path}"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(path)})
    with pytest.raises(ClusterKeyError, match="at least 16"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY": "short"})
    with pytest.raises(ClusterKeyError, match="cannot read"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(tmp_path / "missing")})
    assert isinstance(ClusterKeyError("x"), ConfigError)  # a permanent error: Prefect does not retry it


# ---------------------------------------------------------------------- the config
def multinode(**over) -> ExperimentConfig:
    data = {**BASE, "resources": {"launch": "rendezvous", "rendezvous": {"nnodes": 2}}, **over}
    return parse_config(data)


def test_multinode_needs_storage_every_node_reaches():
    for root in ("runs", "/data/exp", "file:///data/exp"):
        with pytest.raises(ConfigError, match="other nodes .* cannot read: use object storage") as info:
            multinode(storage={"root": root})
        assert "storage.shared_filesystem: true" in str(info.value)
    with pytest.raises(ConfigError, match="lives in one process"):
        multinode(storage={"root": "memory://x"})
    assert multinode(storage={"root": "/nfs/exp", "shared_filesystem": True}).storage.shared_filesystem
    assert multinode(storage={"root": "s3://bucket/ppo"}).resources.launch == "rendezvous"
    assert parse_config({**BASE, "storage": {"root": "runs"}}).resources.launch == "local"  # unchanged


def test_multinode_world_size_is_nodes_times_ranks_per_node():
    s3 = {"root": "s3://b/p"}
    cfg = multinode(storage=s3)
    assert cfg.resources.nprocs == 2
    again = ExperimentConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.resources == cfg.resources
    with pytest.raises(ConfigError, match=r"resources.nprocs=3 must equal rendezvous.nnodes=2 x"):
        parse_config(
            {
                **BASE,
                "storage": s3,
                "resources": {"launch": "rendezvous", "nprocs": 3, "rendezvous": {"nnodes": 2}},
            }
        )
    with pytest.raises(ConfigError, match="must be a multiple of resources.nprocs=8"):
        parse_config(
            {
                **BASE,
                "storage": s3,
                "resources": {"launch": "rendezvous", "rendezvous": {"nnodes": 2, "nproc_per_node": 4}},
            }
        )


# ---------------------------------------------------------------------- the driver's endpoint
@pytest.fixture
def hub():
    lines: list[str] = []
    h = ClusterHub(
        KEY.encode(),
        nnodes=2,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        control_port=0,
        rdzv_port=0,
        log=lines.append,
    )
    h.lines = lines
    yield h
    h.close()


def dial(hub: ClusterHub, key: str = KEY):
    host, port = hub.control_address.rsplit(":", 1)
    return connect((host, int(port)), key.encode(), timeout=5)


def agent_hello(conn, node, nnodes=2, protocol=PROTOCOL) -> Welcome | Refused:
    send(conn, AgentHello(protocol=protocol, node=node, nnodes=nnodes, host="h", pid=9))
    return receive(conn, Welcome, Refused)


def test_the_endpoint_refuses_other_keys_and_misconfigured_agents(hub):
    from multiprocessing.connection import AuthenticationError

    with pytest.raises(AuthenticationError):
        dial(hub, key="another-key-of-enough-length")
    assert agent_hello(dial(hub), node=2).reason.startswith("its node rank 2 is not in 0..1")
    assert "started for 3 nodes" in agent_hello(dial(hub), node=0, nnodes=3).reason
    assert "protocol 7" in agent_hello(dial(hub), node=0, protocol=7).reason
    first = dial(hub)
    assert isinstance(agent_hello(first, node=0), Welcome)
    again = agent_hello(dial(hub), node=0)
    assert isinstance(again, Refused) and again.retry and "already served" in again.reason
    t0 = time.monotonic()
    with pytest.raises(NodesMissing) as info:
        hub.wait_for_agents(1.0)
    assert 1.0 <= time.monotonic() - t0 < 3.0
    msg = str(info.value)
    assert "node(s) [1] never joined within 1 s (joined: node 0 (host h, agent pid 9))" in msg
    assert "failed the cluster-key handshake" in msg and "its node rank 2" in msg
    first.close()
    deadline = time.monotonic() + 5
    while hub.agents() and time.monotonic() < deadline:  # a closed link: the node is gone
        time.sleep(0.02)
    assert hub.agents() == {} and any("node 0 (host h, agent pid 9) left" in line for line in hub.lines)


# ---------------------------------------------------------------------- the agent's side
def test_the_torchrun_line_of_a_node_carries_no_secret():
    cmd = rendezvous_torchrun_command(2, 8, "driver:29400", "ab12-actor-1", 300, "10.0.0.2", "/tmp/logs")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-2:] == [
        "-m",
        "ppoflow.infra.remote.rank.entry",
    ]
    for arg in (
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=driver:29400",
        "--rdzv-id=ab12-actor-1",
        "--rdzv-conf=is_host=false,join_timeout=300",
        "--local-addr=10.0.0.2",
        "--max-restarts=0",
    ):
        assert arg in cmd
    assert not any(KEY in a or "AUTHKEY" in a or "KEY" in a for a in cmd)


def test_node_rank_from_slurm_kubernetes_or_ppoflow():
    assert node_rank_from_env({"SLURM_NODEID": "3"}) == 3
    assert node_rank_from_env({"JOB_COMPLETION_INDEX": "1"}) == 1
    assert node_rank_from_env({"PPOFLOW_NODE_RANK": "0", "SLURM_NODEID": "3"}) == 0
    assert node_rank_from_env({}) is None


def test_node_exit_is_a_rank_fault_entry():
    (fault,) = faults.parse("node_exit:update_actor:1")
    assert fault.kind == "node_exit" and fault.rank_spec == "node_exit:update_actor:1"
