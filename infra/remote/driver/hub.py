"""The driver's side of a multi-node run: one control endpoint for the node agents and the ranks.

A flow run whose ``resources.launch`` is ``rendezvous`` opens one :class:`ClusterHub` (in
``ppoflow.tasks.run.groups``, when its first worker group starts) and closes it when the run ends:

- a TCP listener on ``bind_host:control_port``; every connection passes the mutual HMAC handshake
  with the cluster key (``ppoflow.infra.remote.cluster_key``) before a byte of JSON is read, then
  says what it is: an agent (``{type: agent, node, nnodes, host, pid}``) or a rank
  (``{type: hello, group, rank, ...}``, handed to that group's launcher);
- the c10d rendezvous store (a ``TCPStore`` on ``bind_host:rdzv_port``) that every group's torchrun agents
  meet at, each group with its own run id. The driver hosts it, not a node, so rebuilding one
  group (whose torchrun would otherwise host the store) never pulls it from under another;
- the registry of connected agents (one per node number); a group's launcher waits here until
  every node has an agent (:meth:`wait_for_agents`), naming the missing nodes when time runs out.

Agents (``ppoflow agent``, started on each node by Slurm, Kubernetes or by hand) dial in and stay
connected for the run; ``ppoflow.infra.remote.driver.rendezvous.RendezvousLauncher`` asks them to start
and kill a group's torchrun. When the hub closes, every agent sees its link end and kills what it
still runs.
"""

from __future__ import annotations

import collections
import datetime
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ppoflow.infra.remote.errors import RankFailure
from ppoflow.infra.remote.links import ControlListener, authenticate, hang_up, set_keepalive
from ppoflow.infra.remote.protocol import (
    PROTOCOL,
    AgentError,
    AgentHello,
    Exited,
    Hello,
    Output,
    ProtocolError,
    Refused,
    Started,
    Welcome,
    receive,
    send,
)

__all__ = ["ClusterHub", "AgentLink", "AgentReport", "ClusterError", "NodesMissing"]

#: What an agent reports about one of its groups.
AgentReport = Started | Output | Exited | AgentError


class ClusterError(RuntimeError):
    """The hub cannot serve (a port in use, no cluster key): the message names the setting to fix."""


class NodesMissing(RankFailure):
    """A group could not start because some nodes' agents never connected in time."""


class GroupSink(Protocol):
    """What the hub tells a group's launcher (``RendezvousLauncher`` implements it)."""

    def on_rank(self, conn: Connection, hello: Hello) -> None: ...
    def on_agent_message(self, link: AgentLink, msg: AgentReport) -> None: ...
    def on_agent_lost(self, link: AgentLink) -> None: ...


@dataclass(eq=False)
class AgentLink:
    """One connected node agent."""

    node: int
    host: str
    pid: int
    peer: str
    conn: Connection
    lost: str | None = None
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return f"node {self.node} (host {self.host}, agent pid {self.pid})"

    def send(self, msg: Any) -> bool:
        """Send one message (a :mod:`~ppoflow.infra.remote.protocol` model); False if the link is gone."""
        with self.send_lock:
            try:
                send(self.conn, msg)
                return True
            except OSError:
                return False


class ClusterHub:
    """The control endpoint and rendezvous store of one multi-node driver (module docstring).

    Args:
        key: the cluster key (``load_cluster_key()``).
        nnodes: nodes every group spans (agents must say a node number below it).
        advertise_host: the address agents and ranks reach this process at.
        bind_host, control_port: where the control endpoint listens (port 0: any free one).
        rdzv_port: where the rendezvous store listens (0: any free one).
        log: called with one line per agent joining or leaving, and per refused connection.
    """

    def __init__(
        self,
        key: bytes,
        nnodes: int,
        advertise_host: str,
        bind_host: str = "0.0.0.0",
        control_port: int = 29401,
        rdzv_port: int = 29400,
        log: Callable[[str], None] = print,
    ):
        self.key, self.nnodes, self.log = key, int(nnodes), log
        try:
            self._listener = ControlListener(bind_host, control_port, authkey=key)
        except OSError as err:
            raise ClusterError(
                f"cannot listen on {bind_host}:{control_port} for the node agents ({err}); set "
                "resources.rendezvous.control_port (and bind_host) to a free port and address of this host"
            ) from None
        self.control_port = self._listener.address[1]
        self.advertise_host = advertise_host
        self._store = self._open_store(bind_host, rdzv_port)
        self.rdzv_port = int(self._store.port)
        self._agents: dict[int, AgentLink] = {}
        self._groups: dict[str, GroupSink] = {}
        self._refused: collections.deque[str] = collections.deque(maxlen=5)
        self._cond = threading.Condition()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, name="ppoflow-hub-accept", daemon=True)
        self._accepting.start()

    def _open_store(self, bind_host: str, port: int) -> Any:
        """The rendezvous ``TCPStore``, listening on ``bind_host:port`` only (a socket of ours
        handed to it: torch's own would listen on every interface)."""
        import torch.distributed as dist

        sock = None
        try:
            sock = socket.create_server((bind_host, port), backlog=512)
            local = "127.0.0.1" if bind_host in ("0.0.0.0", "") else bind_host
            store = dist.TCPStore(
                local,
                sock.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=sock.fileno(),
                timeout=datetime.timedelta(seconds=60),
            )
            sock.detach()  # the store owns the listening socket now (and closes it)
            return store
        except (RuntimeError, OSError) as err:
            if sock is not None:
                sock.close()
            self._listener.close()
            raise ClusterError(
                f"cannot host the c10d rendezvous store on {bind_host}:{port} ({err}); set "
                "resources.rendezvous.rdzv_port to a free port of this host"
            ) from None

    # ------------------------------------------------------------------ addresses
    @property
    def control_address(self) -> str:
        """``host:port`` the agents (``ppoflow agent --driver``) and the ranks connect to."""
        return f"{self.advertise_host}:{self.control_port}"

    @property
    def rdzv_endpoint(self) -> str:
        """``host:port`` of the c10d rendezvous store (torchrun's ``--rdzv-endpoint``)."""
        return f"{self.advertise_host}:{self.rdzv_port}"

    # ------------------------------------------------------------------ agents
    def agents(self) -> dict[int, AgentLink]:
        """The connected agents, by node number."""
        with self._cond:
            return dict(self._agents)

    def wait_for_agents(self, timeout_s: float, what: str = "a worker group") -> list[AgentLink]:
        """Block until every node 0..nnodes-1 has a connected agent; :class:`NodesMissing` naming
        the missing nodes (and any refused connections) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise ClusterError("the cluster hub was closed")
                if len(self._agents) == self.nnodes:
                    return [self._agents[n] for n in range(self.nnodes)]
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            missing = [n for n in range(self.nnodes) if n not in self._agents]
            joined = ", ".join(a.name for a in self._agents.values()) or "none"
            refused = list(self._refused)
        hint = (
            f"start `ppoflow agent --driver {self.control_address} --node-rank N` on each missing node, "
            "with the same cluster key (PPOFLOW_CLUSTER_KEY_FILE or PPOFLOW_CLUSTER_KEY), and check "
            f"that it can reach {self.control_address}"
        )
        msg = (
            f"{what} spans {self.nnodes} nodes, but node(s) {missing} never joined within "
            f"{timeout_s:.0f} s (joined: {joined}); {hint}"
        )
        if refused:
            msg += "\nrefused connections: " + "; ".join(refused)
        raise NodesMissing(msg, rank=None, method="__start__")

    # ------------------------------------------------------------------ groups
    def register(self, group_id: str, sink: GroupSink) -> None:
        with self._cond:
            self._groups[group_id] = sink

    def unregister(self, group_id: str) -> None:
        with self._cond:
            self._groups.pop(group_id, None)

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._closed:
            got = self._listener.accept_raw(0.5)
            if got is not None:
                threading.Thread(
                    target=self._handshake, args=got, name="ppoflow-hub-handshake", daemon=True
                ).start()

    def _refuse(self, why: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        with self._cond:
            self._refused.append(f"{stamp} {why}")
        self.log(f"[ppoflow] control endpoint: {why}")

    def _handshake(self, conn: Connection, peer: tuple) -> None:
        """Authenticate, read the first message, hand the link to its owner (or close it)."""
        who = f"{peer[0]}:{peer[1]}"
        if not authenticate(conn, self.key):
            self._refuse(f"a connection from {who} failed the cluster-key handshake (another key?)")
            return
        try:
            if not conn.poll(10.0):
                raise EOFError
            msg = receive(conn, AgentHello, Hello)
        except (EOFError, OSError, ProtocolError) as err:
            if isinstance(err, ProtocolError):
                self._refuse(f"a connection from {who} did not say what it is: {err}")
            conn.close()
            return
        if isinstance(msg, AgentHello):
            self._add_agent(conn, msg, who)
            return
        with self._cond:
            sink = self._groups.get(msg.group)
        if sink is None:  # a straggler of a group that was killed: it exits on EOF
            conn.close()
        else:
            sink.on_rank(conn, msg)

    def _add_agent(self, conn: Connection, msg: AgentHello, who: str) -> None:
        node, nnodes = msg.node, msg.nnodes
        reason = None
        if msg.protocol != PROTOCOL:
            reason = f"it speaks protocol {msg.protocol}, this driver {PROTOCOL} (same ppoflow version?)"
        elif not 0 <= node < self.nnodes:
            reason = f"its node rank {node!r} is not in 0..{self.nnodes - 1} (resources.rendezvous.nnodes={self.nnodes})"
        elif nnodes is not None and nnodes != self.nnodes:
            reason = (
                f"it was started for {nnodes} nodes; this run's resources.rendezvous.nnodes is {self.nnodes}"
            )
        link = AgentLink(node, msg.host, msg.pid, who, conn)
        with self._cond:
            old = self._agents.get(link.node)
            if reason is None and old is not None and old.lost is None:
                reason = f"node {node} is already served by {old.name}"
            if reason is None:  # welcome first: no order may reach the agent before it
                set_keepalive(conn)
                link.send(Welcome(driver=self.control_address))
                self._agents[link.node] = link
                self._cond.notify_all()
        if reason is not None:
            try:  # a node already served may be this agent's own ghost, not yet seen to be gone
                send(conn, Refused(reason=reason, retry="already served" in reason))
            except OSError:
                pass
            conn.close()
            self._refuse(f"refused the agent from {who}: {reason}")
            return
        self.log(f"[ppoflow] {link.name} joined from {who}")
        threading.Thread(
            target=self._read_agent, args=(link,), name=f"ppoflow-agent-{node}", daemon=True
        ).start()

    def _read_agent(self, link: AgentLink) -> None:
        """Route an agent's messages to their groups until its link ends; then tell every group."""
        while True:
            try:
                msg = receive(link.conn, Started, Output, Exited, AgentError)
            except (EOFError, OSError, ProtocolError):
                break
            with self._cond:
                sink = self._groups.get(msg.group)
            if sink is not None:
                sink.on_agent_message(link, msg)
        link.lost = "its agent's link closed (the agent ended, or its host went away)"
        with self._cond:
            closed = self._closed
        if not closed:  # said before the node leaves agents(): whoever sees it gone can read why
            self.log(f"[ppoflow] {link.name} left: {link.lost}")
        with self._cond:
            if self._agents.get(link.node) is link:
                del self._agents[link.node]
            sinks = list(self._groups.values())
        link.conn.close()
        for sink in sinks:
            sink.on_agent_lost(link)

    def close(self) -> None:
        """Stop accepting, close every agent link (their agents kill what they still run), stop
        the rendezvous store. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            agents = list(self._agents.values())
            self._agents.clear()
            self._cond.notify_all()
        self._accepting.join(timeout=2.0)
        self._listener.close()
        for link in agents:
            hang_up(link.conn)  # its reader thread sees EOF and closes it
        self._store = None  # the store's server stops with its last reference
