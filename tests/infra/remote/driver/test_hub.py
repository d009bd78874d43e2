"""Multi-node pieces without ranks: the cluster key, the config's checks, the driver's endpoint
refusing strangers and misconfigured agents, the torchrun line an agent runs."""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.config import ConfigError, ExperimentConfig, parse_config
from ppoflow.infra.remote.driver.hub import ClusterHub, NodesMissing
from ppoflow.infra.remote.links import connect
from ppoflow.infra.remote.protocol import PROTOCOL, AgentHello, Refused, Welcome, receive, send
from ppoflow.infra.runtime import faults

KEY = "k" * 40

BASE = {
    "model": {"path": "some/model"},
    "data": {"train_files": ["train.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 2},
    "critic": {"ppo_mini_batch_size": 2},
}


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


def test_node_exit_is_a_rank_fault_entry():
    (fault,) = faults.parse("node_exit:update_actor:1")
    assert fault.kind == "node_exit" and fault.rank_spec == "node_exit:update_actor:1"
