"""``ppoflow agent``: the per-node process of multi-node worker groups.

    PPOFLOW_CLUSTER_KEY_FILE=~/.ppoflow-cluster-key \\
        ppoflow agent --driver driver-host:29401 --node-rank 1 [--nnodes 2] [--once]

One agent runs on every node of a run whose config says ``resources.launch: rendezvous``, started
by what owns the nodes: ``srun`` in a Slurm job, a pod of a Kubernetes JobSet, or by hand / ssh on
bare hosts (``deploy/`` has the templates). It dials the driver's control endpoint (the flow run's
process) and proves it holds the cluster key; the driver checks its node number. Then the driver
starts and kills worker groups through it: for each group the agent runs

    python -m torch.distributed.run --nnodes=N --nproc-per-node=M --rdzv-backend=c10d
        --rdzv-endpoint=<driver>:<rdzv_port> --rdzv-id=<group id> --max-restarts=0 ...
        -m ppoflow.infra.remote.rank.entry

streams its output to the driver (the Prefect task's log shows it) and reports its exit status.

Why a long-lived agent the driver commands, rather than a torchrun per group started by the
cluster: the flow starts groups lazily and rebuilds them after a failure, on its own schedule; the
cluster's launcher runs once per job. The agent is that one launch; the groups come and go inside
it. The endpoint is known up front (config ``resources.rendezvous``, the agent's ``--driver``);
the secret comes from the environment (``PPOFLOW_CLUSTER_KEY_FILE`` / ``PPOFLOW_CLUSTER_KEY``) and
reaches the ranks in theirs, never on a command line, in storage or in a log.

Lifetime: when the driver's link ends (the flow run finished or died) the agent kills whatever it
still runs and dials again, for the next run; ``--once`` exits instead (a Slurm job's agents end
with its run). SIGTERM/SIGINT kill the groups, then the agent exits. If the agent is SIGKILLed its
ranks notice (they watch its pid) and take torchrun down with them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from multiprocessing import AuthenticationError  # the class connection raises (typeshed has it here)
from multiprocessing.connection import Connection
from typing import Any

from ppoflow.infra.remote.cluster_key import ENV_KEY, ENV_KEY_FILE, ClusterKeyError, load_cluster_key
from ppoflow.infra.remote.links import connect, set_keepalive
from ppoflow.infra.remote.procs import (
    kill_process_group,
    processes_with_env,
    rank_env,
    rendezvous_torchrun_command,
)
from ppoflow.infra.remote.protocol import (
    PROTOCOL,
    AgentError,
    AgentHello,
    Exited,
    Kill,
    Output,
    ProtocolError,
    Refused,
    Start,
    Started,
    Welcome,
    receive,
    send,
)

__all__ = ["Agent", "add_arguments", "run_agent", "node_rank_from_env"]

#: How long an ended group's processes may take to be gone (a rank in an NCCL collective tears its
#: CUDA context down before it exits) before the agent reports the group ended anyway.
GONE_WAIT_S = 30.0
#: Environment variables that say a node's number, in the order they are consulted.
NODE_RANK_VARS = ("PPOFLOW_NODE_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX")
NNODES_VARS = ("SLURM_NNODES", "SLURM_JOB_NUM_NODES")


def node_rank_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The node number from Slurm (``SLURM_NODEID``), a Kubernetes indexed Job / JobSet
    (``JOB_COMPLETION_INDEX``) or ``PPOFLOW_NODE_RANK``; None if none is set."""
    env = os.environ if env is None else env
    for var in NODE_RANK_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


class _Group:
    """One group's torchrun on this node."""

    def __init__(self, gid: str, proc: subprocess.Popen, log_dir: str):
        self.gid, self.proc, self.log_dir = gid, proc, log_dir
        self.pump: threading.Thread | None = None


class Agent:
    """See the module docstring. ``out`` receives the agent's own log lines (never the key)."""

    def __init__(
        self,
        driver: tuple[str, int],
        key: bytes,
        node: int,
        nnodes: int | None = None,
        advertise_addr: str | None = None,
        once: bool = False,
        connect_timeout_s: float | None = None,
        out: Any = None,
    ):
        self.driver, self.key, self.node, self.nnodes = driver, key, int(node), nnodes
        self.advertise_addr, self.once, self.connect_timeout_s = advertise_addr, once, connect_timeout_s
        self._out = out or (lambda line: print(line, flush=True))
        self._groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn: Connection | None = None

    def say(self, text: str) -> None:
        self._out(f"[ppoflow agent node {self.node}] {text}")

    # ------------------------------------------------------------------ session
    def run(self) -> int:
        """Serve drivers until told to stop; the exit status (0 done, 1 no driver, 2 refused)."""
        where = f"{self.driver[0]}:{self.driver[1]}"
        try:
            while True:
                conn = self._dial(where)
                if conn is None:
                    self.say(f"no driver answered at {where} within {self.connect_timeout_s:.0f} s; exiting")
                    return 1
                outcome, reason = self._serve(conn)
                if outcome == "refused":
                    self.say(f"the driver at {where} refused this agent: {reason}")
                    return 2
                if outcome == "retry":  # e.g. our previous link there is not yet seen to be gone
                    self.say(f"the driver at {where} asks to retry: {reason}")
                elif self.once:
                    return 0
                time.sleep(1.0)
        except AuthenticationError:
            self.say(
                f"the driver at {where} holds another cluster key than this agent "
                f"({ENV_KEY_FILE} / {ENV_KEY} must be the same on the driver and every node)"
            )
            return 2
        finally:
            self.kill_all()

    def _dial(self, where: str) -> Connection | None:
        """Connect to the driver, retrying every second (None after ``connect_timeout_s``)."""
        t0 = last_note = time.monotonic()
        self.say(f"waiting for the driver at {where}")
        while True:
            try:
                return connect(self.driver, self.key, timeout=10.0)
            except OSError as err:  # refused, unreachable, unknown host: the driver may come later
                now = time.monotonic()
                if self.connect_timeout_s is not None and now - t0 > self.connect_timeout_s:
                    return None
                if now - last_note > 60:
                    self.say(f"still waiting for the driver at {where} ({err})")
                    last_note = now
                time.sleep(1.0)

    def _serve(self, conn: Connection) -> tuple[str, str]:
        """One driver session: hello, then orders until the link ends. Returns ("ended", ""),
        or ("refused" | "retry", the driver's reason) if it did not take this agent."""
        self._conn = conn
        try:
            set_keepalive(conn)
            hello = AgentHello(
                protocol=PROTOCOL,
                node=self.node,
                nnodes=self.nnodes,
                host=socket.gethostname(),
                pid=os.getpid(),
            )
            self._send(hello)
            reply: Welcome | Refused = (
                receive(conn, Welcome, Refused) if conn.poll(30.0) else Refused(reason="no reply")
            )
            if isinstance(reply, Refused):
                return ("retry" if reply.retry else "refused"), reply.reason
            self.say(f"serving the driver at {reply.driver}")
            while True:
                order = receive(conn, Start, Kill)
                if isinstance(order, Start):
                    self._start_group(order)
                else:
                    self._kill_group(order.group)
        except ProtocolError as err:
            self.say(
                f"the driver sent a message this agent does not understand ({err}); same ppoflow version?"
            )
            return "refused", str(err)
        except (EOFError, OSError):
            self.say("the driver's link ended")
            return "ended", ""
        finally:
            self._conn = None
            conn.close()
            self.kill_all()

    def _send(self, msg: AgentHello | Started | Output | Exited | AgentError) -> None:
        with self._send_lock:
            if self._conn is not None:
                try:
                    send(self._conn, msg)
                except OSError:
                    pass  # the reader sees the link end and cleans up

    # ------------------------------------------------------------------ groups
    def _start_group(self, order: Start) -> None:
        gid = order.group
        try:
            host, _, port = order.driver_addr.rpartition(":")
            nproc = order.nproc_per_node
            env = {k: v for k, v in os.environ.items() if k not in (ENV_KEY, ENV_KEY_FILE)}
            env.update(order.env)
            env = rank_env(env, (host, int(port)), self.key, order.worker, order.device, nproc)
            env.update(
                {
                    "PPOFLOW_DRIVER_PID": str(os.getpid()),  # the ranks exit when this agent dies
                    "PPOFLOW_AGENT_PID": str(os.getpid()),
                    "PPOFLOW_GROUP_ID": gid,
                    "PPOFLOW_NODE_RANK": str(self.node),
                }
            )
            log_dir = tempfile.mkdtemp(prefix=f"ppoflow-{gid}-")
            cmd = rendezvous_torchrun_command(
                nnodes=order.nnodes,
                nproc_per_node=nproc,
                endpoint=order.rdzv_endpoint,
                run_id=gid,
                join_timeout_s=order.join_timeout_s,
                local_addr=self.advertise_addr,
                log_dir=log_dir,
            )
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except Exception as err:  # noqa: BLE001 - reported to the driver, which fails the group
            self._send(AgentError(group=gid, error=f"{type(err).__name__}: {err}"))
            return
        group = _Group(gid, proc, log_dir)
        with self._lock:
            self._groups[gid] = group
        self.say(f"started group {gid}: torchrun pid {proc.pid}")
        self._send(Started(group=gid, pid=proc.pid))
        group.pump = threading.Thread(target=self._pump, args=(group,), name=f"ppoflow-{gid}", daemon=True)
        group.pump.start()

    def _pump(self, group: _Group) -> None:
        """Forward torchrun's output line by line; report its exit; clean up after it."""
        assert group.proc.stdout is not None  # stdout=PIPE
        for raw in iter(group.proc.stdout.readline, b""):
            self._send(Output(group=group.gid, line=raw.decode("utf-8", "replace").rstrip()))
        group.proc.stdout.close()
        status = group.proc.wait()
        self._kill_stragglers(group.gid)
        deadline = time.monotonic() + GONE_WAIT_S  # "exited" promises the group's processes are gone:
        while self._mine(group.gid) and time.monotonic() < deadline:  # a GPU is free only then
            time.sleep(0.05)
        with self._lock:
            self._groups.pop(group.gid, None)
        shutil.rmtree(group.log_dir, ignore_errors=True)
        self.say(f"group {group.gid} ended (status {status})")
        self._send(Exited(group=group.gid, status=status))

    @staticmethod
    def _mine(gid: str) -> list[int]:
        """This agent's processes of group ``gid`` (torchrun and its ranks), by their environment
        (ranks left behind by a torchrun that died are no longer its children)."""
        return processes_with_env(PPOFLOW_GROUP_ID=gid, PPOFLOW_AGENT_PID=str(os.getpid()))

    def _kill_stragglers(self, gid: str) -> None:
        """Ranks of ``gid`` still alive after their torchrun ended (they watch this agent, not
        torchrun)."""
        for pid in self._mine(gid):
            try:
                if os.getpgid(pid) == pid:  # a rank leads its own session: take what it spawned too
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def _kill_group(self, gid: str) -> None:
        with self._lock:
            group = self._groups.get(gid)
        if group is not None:
            kill_process_group(group.proc, self._mine(gid), wait_s=0.0)
            # the pump sees the output end, reaps torchrun and reports "exited"

    def kill_all(self) -> None:
        """Kill every group this agent runs and wait (briefly) for their pumps to report."""
        with self._lock:
            groups = list(self._groups.values())
        for group in groups:
            kill_process_group(group.proc, self._mine(group.gid), wait_s=0.0)
        for group in groups:
            if group.pump is not None:
                group.pump.join(timeout=5.0)


# ---------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ppoflow agent``."""
    parser.add_argument(
        "--driver",
        default=os.environ.get("PPOFLOW_DRIVER"),
        help="HOST:PORT of the driver's control endpoint (resources.rendezvous.driver_host and "
        "control_port; default: $PPOFLOW_DRIVER)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's number, 0..nnodes-1 (default: $PPOFLOW_NODE_RANK, $SLURM_NODEID or "
        "$JOB_COMPLETION_INDEX)",
    )
    parser.add_argument(
        "--nnodes", type=int, default=None, help="nodes of the run, checked against the driver's config"
    )
    parser.add_argument(
        "--advertise-addr",
        default=None,
        help="address other nodes reach this one at (torchrun --local-addr; default: its FQDN)",
    )
    parser.add_argument("--once", action="store_true", help="exit when the first driver's run ends")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up if no driver answers for this long (default: keep trying)",
    )


def run_agent(args: argparse.Namespace) -> int:
    """``ppoflow agent``: check the options and the key, then serve; returns the exit status."""
    if not args.driver or ":" not in args.driver:
        print("ppoflow agent: error: --driver HOST:PORT is required (or set PPOFLOW_DRIVER)", file=sys.stderr)
        return 2
    node = args.node_rank if args.node_rank is not None else node_rank_from_env()
    if node is None or node < 0:
        print(
            "ppoflow agent: error: give this node's number with --node-rank (0..nnodes-1), or run "
            f"it where one of {', '.join(NODE_RANK_VARS)} is set",
            file=sys.stderr,
        )
        return 2
    nnodes = args.nnodes
    if nnodes is None:
        nnodes = next((int(os.environ[v]) for v in NNODES_VARS if os.environ.get(v, "").isdigit()), None)
    try:
        key = load_cluster_key(who="ppoflow agent")
    except ClusterKeyError as err:
        print(f"ppoflow agent: error: {err}", file=sys.stderr)
        return 2
    host, _, port = args.driver.rpartition(":")
    agent = Agent(
        (host, int(port)),
        key,
        node,
        nnodes=nnodes,
        advertise_addr=args.advertise_addr,
        once=args.once,
        connect_timeout_s=args.connect_timeout,
    )
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return agent.run()
    except KeyboardInterrupt:
        return 130
