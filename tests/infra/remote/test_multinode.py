"""Worker groups whose ranks span "nodes": real ``ppoflow agent`` processes on 127.0.0.1, each a
node with its own torchrun, one gloo rank each, meeting in a c10d rendezvous the driver (this
test process) hosts; DataProto chunks on S3 (moto).

What must hold, against independent references: a DP call over two nodes equals the plain
function on the whole batch; each rank really runs under its own node's agent; a killed agent
fails the call within seconds naming the node, leaves no process behind, and a rebuilt group on a
restarted agent works; a node that never joins, or whose torchrun never reaches the rendezvous,
fails the start with the node named and nothing left running; agents with another key, node rank
or node count are refused with the reason; agents outlive a driver and serve the next one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.driver.group import WorkerGroup
from ppoflow.infra.remote.driver.hub import ClusterHub, NodesMissing
from ppoflow.infra.remote.driver.rendezvous import RendezvousLauncher
from ppoflow.infra.remote.errors import RankFailure
from ppoflow.infra.remote.links import connect
from ppoflow.infra.remote.protocol import PROTOCOL, AgentHello, Exited, Kill, Start, Welcome, receive, send
from tests.support.nodes import KEY, Agents
from tests.support.ports import free_port
from tests.support.toy_workers import double_plus

pytestmark = pytest.mark.slow

TOY = "tests.support.toy_workers:ToyWorker"


class Lines(list):
    """A ``log`` callable that keeps the lines (truthy even while empty)."""

    def __call__(self, line: str) -> None:
        self.append(line)

    def __bool__(self) -> bool:
        return True


def make_hub(nnodes: int = 2, port: int = 0, log=None) -> ClusterHub:
    return ClusterHub(
        KEY.encode(),
        nnodes=nnodes,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        control_port=port,
        rdzv_port=0,
        log=log or Lines(),
    )


def make_group(hub: ClusterHub, gid: str, scratch: str, join_timeout_s: float = 60.0, **kw) -> WorkerGroup:
    launcher = RendezvousLauncher(hub, 1, gid, storage.join(scratch, gid), join_timeout_s=join_timeout_s)
    return WorkerGroup(TOY, nprocs=hub.nnodes, config={"answer": 42}, launcher=launcher, grace_s=1.0, **kw)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A hub for 2 nodes and an agent for each (module-wide; tests may kill and restart one)."""
    hub = make_hub()
    agents = Agents(hub.control_address, tmp_path_factory.mktemp("agents"))
    agents.start(0)
    agents.start(1)
    hub.wait_for_agents(60)
    yield hub, agents
    hub.close()
    agents.stop_all()
    assert agents.wait_no_descendants() == []


def test_a_group_spans_two_agents_and_dp_equals_the_plain_function(cluster, s3_server):
    hub, agents = cluster
    scratch = f"{s3_server['url']}/multinode-scratch"
    lines = Lines()
    group = make_group(hub, "span-1", scratch, log=lines)
    t0 = time.monotonic()
    with group:
        print(f"\n[timing] 2-node group start {time.monotonic() - t0:.2f} s")
        info = group.call("info")
        assert [r["world_size"] for r in info] == [2, 2] and [r["allreduce"] for r in info] == [3.0, 3.0]
        # each rank runs under its own node's agent (PPOFLOW_AGENT_PID in its environment)
        nodes = {rank: hello.node for rank, hello in group.hellos.items()}
        assert sorted(nodes.values()) == [0, 1]
        for rank, node in nodes.items():
            env = open(f"/proc/{group.pids[rank]}/environ", "rb").read().split(b"\0")
            assert f"PPOFLOW_AGENT_PID={agents.procs[node].pid}".encode() in env
        assert any("group span-1: node 0" in line for line in lines)

        g = torch.Generator().manual_seed(3)
        x = torch.randn(7, 3, generator=g)  # 7 rows: padded to 8 for 2 ranks, padding removed
        data = DataProto.from_dict(
            tensors={"x": x, "id": torch.arange(7)},
            non_tensors={"name": np.array([f"r{i}" for i in range(7)], dtype=object)},
        )
        in_url, out_url = f"{scratch}/in.arrow", f"{scratch}/out.arrow"
        data.save(in_url)
        assert group.call("double", in_url, out_url=out_url) == out_url
        out = DataProto.load(out_url)
        assert torch.equal(out.batch["id"], torch.arange(7))
        assert torch.equal(out.batch["y"], double_plus(x))
        assert list(out.non_tensor_batch["name"]) == [f"r{i}" for i in range(7)]
        assert not storage.exists(f"{scratch}/span-1/call-000002")  # the call's chunks are gone
    assert not storage.exists(f"{scratch}/span-1")  # and the group's scratch space
    for node in (0, 1):
        assert "group span-1 ended (status 0)" in agents.log(node)  # a clean exit on both nodes
    assert agents.wait_no_descendants() == []


def test_a_killed_agent_fails_the_call_within_seconds_naming_its_node(cluster, tmp_path):
    hub, agents = cluster
    group = make_group(hub, "lost-1", str(tmp_path)).start()
    ranks_on_1 = sorted(r for r, h in group.hellos.items() if h.node == 1)
    died: dict[str, float] = {}
    killer = threading.Timer(1.0, lambda: died.update(at=agents.kill(1)))
    killer.start()
    with pytest.raises(RankFailure) as info:
        group.call("sleep", 60.0)
    failed_at = time.time()
    killer.join()
    msg = str(info.value)
    print(f"\n[timing] call failed {failed_at - died['at']:.2f} s after the agent died")
    assert failed_at - died["at"] < 5.0
    assert msg.startswith("node 1 (host ") and "was lost" in msg and f"ranks {ranks_on_1} ran there" in msg
    assert not group.alive
    assert agents.wait_no_descendants() == []  # node 0's torchrun and rank killed, node 1's gone

    agents.start(1)  # what Slurm/Kubernetes would do: a new agent for the node
    with make_group(hub, "lost-2", str(tmp_path)) as rebuilt:
        assert [r["allreduce"] for r in rebuilt.call("info")] == [3.0, 3.0]
    assert agents.wait_no_descendants() == []


def test_node_exit_drill_loses_the_node_of_that_rank(cluster, tmp_path):
    hub, agents = cluster
    group = make_group(hub, "drill-1", str(tmp_path), env={"PPOFLOW_FAULT": "node_exit:echo:1"}).start()
    node = group.hellos[1].node
    with pytest.raises(RankFailure) as info:
        group.call("echo", 1)
    assert str(info.value).startswith(f"node {node} (host ") and "was lost" in str(info.value)
    assert agents.procs[node].wait(timeout=10) == -9
    assert agents.wait_no_descendants() == []
    agents.start(node)
    hub.wait_for_agents(60)


def test_a_node_that_never_joins_times_out_naming_it(tmp_path):
    hub = make_hub()
    agents = Agents(hub.control_address, tmp_path)
    try:
        agents.start(0)
        group = make_group(hub, "never-1", str(tmp_path), join_timeout_s=4.0)
        t0 = time.monotonic()
        with pytest.raises(NodesMissing) as info:
            group.start()
        took = time.monotonic() - t0
        msg = str(info.value)
        assert "spans 2 nodes, but node(s) [1] never joined within 4 s" in msg
        assert "joined: node 0 (host " in msg and f"ppoflow agent --driver {hub.control_address}" in msg
        assert 4.0 <= took < 10.0 and not group.alive
        assert agents.descendants() == [] and agents.procs[0].poll() is None  # the agent itself stays
    finally:
        hub.close()
        agents.stop_all()


def test_a_node_whose_torchrun_never_reaches_the_rendezvous(tmp_path):
    """Node 1's agent is there (a stand-in that takes orders and does nothing), node 0's torchrun
    waits at the rendezvous until its join timeout: the start fails naming both, nothing is left."""
    hub = make_hub()
    agents = Agents(hub.control_address, tmp_path)
    host, port = hub.control_address.rsplit(":", 1)
    ghost = connect((host, int(port)), KEY.encode())
    orders: list[Start | Kill] = []

    def stand_in() -> None:  # takes orders, starts nothing, confirms kills
        try:
            while True:
                orders.append(receive(ghost, Start, Kill))
                if isinstance(orders[-1], Kill):
                    send(ghost, Exited(group=orders[-1].group, status=-9))
        except (EOFError, OSError):
            pass

    try:
        send(ghost, AgentHello(protocol=PROTOCOL, node=1, nnodes=2, host="ghost", pid=1))
        receive(ghost, Welcome)
        threading.Thread(target=stand_in, daemon=True).start()
        agents.start(0)
        group = make_group(hub, "stuck-1", str(tmp_path), join_timeout_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            group.start()
        print(f"\n[timing] failed {time.monotonic() - t0:.1f} s after the start (join timeout 5 s)")
        msg = str(info.value)
        assert "torchrun on node 0 (host " in msg and "before all ranks connected" in msg
        assert "ranks missing from node 0" in msg and "node 1 (host ghost" in msg
        assert "RendezvousTimeoutError" in msg  # torchrun's own report, from node 0's output
        assert [o.type for o in orders] == ["start", "kill"]  # the stand-in got its order and the kill
        assert agents.wait_no_descendants() == []
    finally:
        ghost.close()
        hub.close()
        agents.stop_all()


def test_agents_with_another_key_node_or_size_are_refused_with_the_reason(tmp_path):
    log = Lines()
    hub = make_hub(log=log)
    agents = Agents(hub.control_address, tmp_path)
    try:
        wrong_key = agents.start(0, key="another-key-" + "x" * 20)
        assert wrong_key.wait(timeout=30) == 2
        assert "holds another cluster key" in agents.log(0)
        bad_node = agents.start(5)
        assert bad_node.wait(timeout=30) == 2 and "its node rank 5 is not in 0..1" in agents.log(5)
        bad_size = agents.start(1, "--nnodes", "3")
        assert bad_size.wait(timeout=30) == 2 and "started for 3 nodes" in agents.log(1)
        with pytest.raises(NodesMissing) as info:
            hub.wait_for_agents(0.5)
        assert "failed the cluster-key handshake" in str(info.value)
        assert "refused connections" in str(info.value)
    finally:
        hub.close()
        agents.stop_all()


def test_agents_serve_the_next_driver_and_once_agents_exit(tmp_path):
    port = free_port()
    hub = make_hub(port=port)
    agents = Agents(hub.control_address, tmp_path)
    try:
        agents.start(0)
        once = agents.start(1, "--once")
        hub.wait_for_agents(60)
        hub.close()  # the run ends
        assert once.wait(timeout=30) == 0
        hub = make_hub(port=port)  # the next run, same endpoint
        agents.start(1)
        assert sorted(hub.wait_for_agents(60), key=lambda a: a.node)[0].pid == agents.procs[0].pid
    finally:
        hub.close()
        agents.stop_all()
