"""``RendezvousLauncher``: a ``WorkerGroup`` whose ranks span nodes, started by the nodes' agents.

    hub = ClusterHub(load_cluster_key(), nnodes=2, advertise_host="10.0.0.1")
    launcher = RendezvousLauncher(hub, nproc_per_node=8, group_id="a1b2c3d4-actor-1",
                                  scratch_url="s3://bucket/exp/scratch/a1b2c3d4-actor-1")
    group = WorkerGroup(worker, nprocs=16, config=cfg, device="cuda", launcher=launcher).start()

``start`` waits (up to ``join_timeout_s``) until every node has a connected agent, then asks each
agent to run ``torchrun --nnodes=N --nproc-per-node=M --rdzv-backend=c10d --rdzv-endpoint=<the
driver's store> --rdzv-id=<group id>``; torchrun's c10d rendezvous gives the ranks their global
numbers, the ranks dial the driver's control endpoint (authenticated with the cluster key) and
say hello with the group id and their node. The agents stream torchrun's output here line by line
(into the group's ``log``, lines of torchrun itself prefixed ``[nodeK]``) and report when it exits.

Failure: a node whose agent's link closes is *lost*; one whose torchrun exits or cannot start has
*failed*; either makes ``failure()`` say which node, on which host, with which ranks, and wakes the
``WorkerGroup`` through ``event_fd``; the group then kills every node's torchrun (``release``) and
raises ``RankFailure`` with that node's last output. DataProto chunks of DP calls go under
``scratch_url`` (storage every node reads), removed at release.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from ppoflow.infra.data import storage
from ppoflow.infra.remote.driver.hub import AgentLink, AgentReport, ClusterHub
from ppoflow.infra.remote.driver.launchers import Launcher
from ppoflow.infra.remote.protocol import AgentError, Exited, Hello, Kill, Output, Start

__all__ = ["RendezvousLauncher"]

#: How long ``release`` waits for the agents to confirm that a group's processes are gone (on GPUs
#: the group that replaces it needs their device memory back).
KILL_WAIT_S = 35.0


class RendezvousLauncher(Launcher):
    """The ranks of one group on ``hub.nnodes`` nodes x ``nproc_per_node`` (module docstring)."""

    names_nodes = True

    def __init__(
        self,
        hub: ClusterHub,
        nproc_per_node: int,
        group_id: str,
        scratch_url: str,
        join_timeout_s: float = 300.0,
    ):
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
        self.hub, self.nnodes, self.nproc_per_node = hub, hub.nnodes, int(nproc_per_node)
        self.nprocs = self.nnodes * self.nproc_per_node
        self.group_id, self.join_timeout_s = group_id, float(join_timeout_s)
        self.scratch = scratch_url
        self.rank_pids = []
        self.log: Callable[[str], None] = lambda line: None
        self._inbox: queue.Queue[tuple[Connection, Hello]] = queue.Queue()
        self._links: dict[int, AgentLink] = {}
        self._exited: dict[int, int] = {}
        self._lost: dict[int, str] = {}
        self._errors: dict[int, str] = {}
        self._ranks: dict[int, list[int]] = collections.defaultdict(list)
        self._node_tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=60)
        )
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._lock = threading.Lock()
        self._event_r: int | None  # None once released
        self._event_w: int | None
        self._event_r, self._event_w = os.pipe()
        os.set_blocking(self._event_w, False)
        self._released = False

    # ------------------------------------------------------------------ start
    def start(self, worker: str, device: str, env: dict[str, str], log: Callable[[str], None]) -> None:
        self.log = log
        self.hub.register(self.group_id, self)  # before any torchrun starts: hellos come fast
        links = self.hub.wait_for_agents(self.join_timeout_s, what=f"worker group {self.group_id}")
        with self._lock:
            self._links = {link.node: link for link in links}
        order = Start(
            group=self.group_id,
            worker=worker,
            device=device,
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            rdzv_endpoint=self.hub.rdzv_endpoint,
            driver_addr=self.hub.control_address,
            join_timeout_s=self.join_timeout_s,
            env=dict(env),
        )
        for link in links:
            if not link.send(order):
                self.on_agent_lost(link)

    def poll_hello(self, timeout: float) -> tuple[Connection, Hello] | None:
        try:
            conn, hello = self._inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        with self._lock:
            self.rank_pids.append(hello.pid)
            self._ranks[hello.node].append(hello.rank)
        return conn, hello

    # ------------------------------------------------------------------ from the hub
    def on_rank(self, conn: Connection, hello: Hello) -> None:
        if self._released:
            conn.close()
        else:
            self._inbox.put((conn, hello))

    def on_agent_message(self, link: AgentLink, msg: AgentReport) -> None:
        node = link.node
        if isinstance(msg, Output):
            line = msg.line
            shown = line if line.startswith("[rank") else f"[node{node}] {line}"
            with self._lock:
                self._node_tails[node].append(line)
                self._tail.append(shown)
            try:
                self.log(shown)
            except Exception:  # noqa: BLE001 - a broken logger must not stop the agent's reader
                pass
        elif isinstance(msg, Exited):
            with self._lock:
                self._exited[node] = msg.status
            self._signal()
        elif isinstance(msg, AgentError):
            with self._lock:
                self._errors[node] = msg.error
            self._signal()

    def on_agent_lost(self, link: AgentLink) -> None:
        with self._lock:
            if self._links.get(link.node) is not link or link.node in self._exited:
                return
            self._lost[link.node] = link.lost or "its agent's link closed"
        self._signal()

    def _signal(self) -> None:
        with self._lock:
            if self._event_w is not None:
                try:
                    os.write(self._event_w, b"!")
                except (BlockingIOError, OSError):
                    pass

    # ------------------------------------------------------------------ state
    @property
    def event_fd(self) -> int | None:
        return self._event_r

    def _node_name(self, node: int) -> str:
        link = self._links.get(node)
        return link.name if link is not None else f"node {node}"

    def _ranks_note(self, node: int) -> str:
        ranks = sorted(self._ranks.get(node, []))
        return f"; ranks {ranks} ran there" if ranks else ""

    def failed_node(self) -> int | None:
        """The node whose fate ``failure()`` reports (lost first, then failed to start, then exited)."""
        with self._lock:
            for table in (self._lost, self._errors, self._exited):
                if table:
                    return min(table)
        return None

    def failure(self) -> str | None:
        with self._lock:
            if self._lost:
                node = min(self._lost)
                return f"{self._node_name(node)} was lost: {self._lost[node]}{self._ranks_note(node)}"
            if self._errors:
                node = min(self._errors)
                return f"the agent of {self._node_name(node)} could not start torchrun: {self._errors[node]}"
            if self._exited:
                node = min(self._exited)
                return (
                    f"torchrun on {self._node_name(node)} exited (status {self._exited[node]})"
                    f"{self._ranks_note(node)}"
                )
        return None

    def wait(self, timeout: float) -> bool:
        """True once torchrun ended on every node (or the node was lost)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                done = all(n in self._exited or n in self._lost for n in self._links)
            if done or time.monotonic() >= deadline:
                return done
            time.sleep(0.05)

    def output_tail(self, n: int = 200) -> str:
        with self._lock:
            merged = list(self._tail)[-n:]
            node = next(iter(sorted(self._lost) or sorted(self._errors) or sorted(self._exited)), None)
            own = list(self._node_tails.get(node, ())) if node is not None else []
        if not own:
            return "\n".join(merged)
        return "\n".join([f"(node {node}, its last lines first)", *own, "(all nodes)", *merged])

    def describe(self) -> str:
        return (
            f"{self.nprocs} ranks on {self.nnodes} nodes x {self.nproc_per_node} (rendezvous "
            f"{self.group_id} at {self.hub.rdzv_endpoint}, control {self.hub.control_address})"
        )

    def placement(self, hellos: dict[int, Hello]) -> str | None:
        by_node: dict[int, list[int]] = collections.defaultdict(list)
        for rank, hello in hellos.items():
            by_node[hello.node].append(rank)
        nodes = "; ".join(
            f"{self._node_name(node)}: ranks {sorted(ranks)}" for node, ranks in sorted(by_node.items())
        )
        return f"group {self.group_id}: {nodes}"

    def missing(self, hellos: dict[int, Hello]) -> str:
        count = collections.Counter(h.node for h in hellos.values())
        short = [n for n in range(self.nnodes) if count[n] < self.nproc_per_node]
        if not short:
            return ""
        names = ", ".join(self._node_name(n) for n in short)
        return f"; ranks missing from {names} (did its torchrun reach the rendezvous at {self.hub.rdzv_endpoint}?)"

    # ------------------------------------------------------------------ end
    def release(self) -> None:
        """Have every live agent kill the group's processes (waiting up to ``KILL_WAIT_S`` for
        them to confirm), drop unclaimed rank links, remove the scratch space. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            live = [
                link
                for node, link in self._links.items()
                if node not in self._exited and node not in self._lost and link.lost is None
            ]
        for link in live:
            link.send(Kill(group=self.group_id))
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            with self._lock:
                if all(link.node in self._exited or link.lost is not None for link in live):
                    break
            time.sleep(0.05)
        else:
            self.log(f"[ppoflow] agents did not confirm the end of group {self.group_id} in {KILL_WAIT_S} s")
        self.hub.unregister(self.group_id)
        while not self._inbox.empty():
            self._inbox.get_nowait()[0].close()
        with self._lock:
            assert self._event_w is not None  # released once (_released above)
            os.close(self._event_w)
            self._event_w = None
        assert self._event_r is not None
        os.close(self._event_r)
        self._event_r = None
        scratch, self.scratch = self.scratch, None
        try:
            if scratch is not None and storage.exists(scratch):
                storage.rm(scratch, recursive=True)
        except (OSError, ValueError) as err:
            self.log(f"[ppoflow] could not remove the group's scratch space {scratch}: {err}")
