"""Entry point of one rank of a ``ppoflow.infra.remote.driver.group.WorkerGroup``: its ``main``, run
by every rank that :mod:`ppoflow.infra.remote.rank.launch` starts (forked from the launcher on CPU,
``torchrun ... -m ppoflow.infra.remote.rank.entry`` on CUDA).

The driver (``WorkerGroup``) starts torchrun with these environment variables:

    PPOFLOW_DRIVER_ADDR   "host:port" of the driver's control listener
    PPOFLOW_AUTHKEY       hex authkey of that listener
    PPOFLOW_DRIVER_PID    pid of the local process that owns this rank: the driver (a group on the
                          driver's host) or the node's agent (a group spanning hosts); the rank
                          exits (status 1) as soon as it dies
    PPOFLOW_GROUP_ID      the group's id (its rendezvous id), sent in the hello (multi-node groups)
    PPOFLOW_NODE_RANK     the agent's node number, sent in the hello (multi-node groups; default 0)
    PPOFLOW_AGENT_PID     the node's agent (multi-node groups), for the ``node_exit`` drill
    PPOFLOW_WORKER        "module:Class" of the worker, imported here with importlib
    PPOFLOW_DEVICE        "cpu" (gloo) or "cuda" (nccl for CUDA tensors, gloo for CPU tensors)
    PPOFLOW_RANK_THREADS  torch intra-op threads (default max(1, cpu_count // local_world_size))
    PPOFLOW_FAULT         optional fault injection, see below

Life of a rank (the messages are :mod:`ppoflow.infra.remote.protocol`'s): init torch.distributed
-> connect to the driver -> send :class:`Hello` -> receive :class:`Init` -> build the worker ->
reply :class:`Ready` (its registered methods and layout, or the failure) -> loop over commands:
a :class:`Call` gets a :class:`Reply`; :class:`Shutdown` runs ``worker.shutdown()``, frees the
worker, gc, barrier, destroys the process group, replies and ends the rank (``_end``).

Calling convention: for DP_COMPUTE_PROTO, ``in_url`` is this rank's input chunk; the rank calls
``method(worker, DataProto.load(in_url), *args, **kwargs)``; a DataProto result is saved at
``out_url`` (only on ranks with ``is_output_rank``) and the reply carries ``kind: "dataproto"`` and
the URL, with the metric merge rules the method was registered with (``metric_rules``: the
driver merges the dp shards' ``meta_info["metrics"]`` by them); any other result travels as JSON
(``kind: "json"``). ONE_TO_ALL and RANK_ZERO methods get the JSON args/kwargs and must return JSON.

Fault injection (for chaos tests), env ``PPOFLOW_FAULT``, comma-separated entries:
    rank_exit:<method>:<rank>   the rank calls ``os._exit(17)`` at the start of <method>
    rank_raise:<method>:<rank>  the rank raises ``RuntimeError("injected fault ...")`` there
    node_exit:<method>:<rank>   the rank SIGKILLs its node's agent (``PPOFLOW_AGENT_PID``) there and
                                 goes down with it: the whole node is lost (multi-node groups)
"""

from __future__ import annotations

import gc
import importlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from ppoflow.infra.remote.dispatch import Dispatch, dispatch_mode_of, metric_rules_of, registered_methods
from ppoflow.infra.remote.errors import error_types
from ppoflow.infra.remote.procs import LAUNCH_MODULE, block_until_exit
from ppoflow.infra.remote.protocol import (
    Call,
    Failure,
    Hello,
    Init,
    Layout,
    Ready,
    Reply,
    Shutdown,
    receive,
    send,
)
from ppoflow.infra.remote.rank.seeding import seed_rngs
from ppoflow.infra.runtime import faults

FAULT_EXIT_CODE = 17
#: How long a forked rank's interpreter may take to exit after a clean shutdown (see ``_end``).
EXIT_GRACE_S = 30.0


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - ending anyway
            pass


def _flush_and_exit(code: int) -> None:
    _flush()
    os._exit(code)


def _watch_driver(driver_pid: int) -> None:
    """Thread body: end this rank as soon as the driver process dies."""
    block_until_exit(driver_pid)
    _orphaned(f"driver pid {driver_pid} is gone")


def _orphaned(why: str) -> None:
    """The driver is gone (or dropped this group): no orphans may outlive it. Kill the parent
    torchrun (its output has no reader left) and this rank's process group: a spawned rank leads
    a session of its own (the rank and whatever it spawned), a forked one is in its launcher's
    (the launcher, its sibling ranks and what they spawned). Then exit 1."""
    print(f"[ppoflow] {why}; rank exits", file=sys.stderr, flush=True)
    try:
        ppid, pgid = os.getppid(), os.getpgid(0)
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            parent = f.read()
        launched = b"torch.distributed.run" in parent or LAUNCH_MODULE.encode() in parent
        if launched and pgid == ppid:
            # forked: one signal for the launcher's group (not the launcher first: its death
            # sends this rank SIGINT, which torch's handler turns into an exception right here)
            os.killpg(pgid, signal.SIGKILL)
        if launched:
            os.kill(ppid, signal.SIGKILL)
        if pgid == os.getpid():
            os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    _flush_and_exit(1)


def _layout(worker: Any) -> Layout:
    return Layout(
        dp_rank=int(getattr(worker, "dp_rank", dist.get_rank())),
        dp_size=int(getattr(worker, "dp_size", dist.get_world_size())),
        is_output_rank=bool(getattr(worker, "is_output_rank", True)),
    )


def _failure(exc: BaseException) -> Failure:
    return Failure(
        error=f"{type(exc).__name__}: {exc}", error_types=error_types(exc), traceback=traceback.format_exc()
    )


def _is_dataproto(obj: Any) -> bool:
    mod = sys.modules.get("ppoflow.infra.data.dataproto")
    return mod is not None and isinstance(obj, mod.DataProto)


class RankServer:
    """The command loop of one rank: owns the worker and the driver connection."""

    def __init__(self, conn: Connection, worker_path: str, faults: set[tuple[str, str, int]]):
        self.conn = conn
        self.worker_path = worker_path
        self.faults = faults
        self.rank = dist.get_rank()
        self.worker: Any = None
        self.cls: type | None = None

    def build(self, config: dict[str, Any]) -> None:
        """Import the worker class by its "module:Class" path and construct it with ``config``."""
        try:
            module_name, _, cls_name = self.worker_path.partition(":")
            if not cls_name:
                raise ValueError(f"worker path must be 'module:Class', got {self.worker_path!r}")
            self.cls = getattr(importlib.import_module(module_name), cls_name)
            # the global RNGs start from OS entropy in a new process: give them a start that depends
            # only on the rank, so two runs of one config save the same RNG states in their
            # checkpoints (workers still seed what their math uses themselves)
            seed_rngs(self.rank)
            self.worker = self.cls(config)
            methods = {k: v.value for k, v in registered_methods(self.cls).items()}
            send(self.conn, Ready(ok=True, methods=methods, layout=_layout(self.worker)))
        except BaseException as e:  # noqa: BLE001 - reported to the driver
            send(self.conn, Ready(ok=False, failure=_failure(e)))

    def _inject(self, method: str) -> None:
        if ("rank_exit", method, self.rank) in self.faults:
            print(
                f"[ppoflow] injected fault: rank {self.rank} exits in {method}", file=sys.stderr, flush=True
            )
            _flush_and_exit(FAULT_EXIT_CODE)
        if ("rank_raise", method, self.rank) in self.faults:
            raise RuntimeError(f"injected fault (PPOFLOW_FAULT) in {method} on rank {self.rank}")
        if ("node_exit", method, self.rank) in self.faults:
            agent = os.environ.get("PPOFLOW_AGENT_PID")
            if not agent:
                raise RuntimeError(
                    "PPOFLOW_FAULT node_exit needs a group whose ranks run under a node agent "
                    "(resources.launch: rendezvous); use rank_exit on a local group"
                )
            print(
                f"[ppoflow] injected fault: rank {self.rank} kills its node's agent (pid {agent}) in {method}",
                file=sys.stderr,
                flush=True,
            )
            os.kill(int(agent), signal.SIGKILL)
            _orphaned(f"rank {self.rank}: its node's agent was killed (PPOFLOW_FAULT)")

    def call(self, cmd: Call) -> Reply:
        """Run one command; the reply (``ok`` False with the traceback on any exception)."""
        method = cmd.method
        try:
            if self.worker is None:
                raise RuntimeError("the worker was not constructed")
            assert self.cls is not None  # the worker's class, set with it
            mode = dispatch_mode_of(self.cls, method)
            self._inject(method)
            fn = getattr(self.worker, method)
            if mode is Dispatch.DP_COMPUTE_PROTO:
                from ppoflow.infra.data.dataproto import DataProto

                if cmd.in_url is None:
                    raise ValueError(f"{method} is DP_COMPUTE_PROTO but the call names no input chunk")
                result = fn(DataProto.load(cmd.in_url), *cmd.args, **cmd.kwargs)
            else:
                result = fn(*cmd.args, **cmd.kwargs)
            layout = _layout(self.worker)
            if _is_dataproto(result):
                if mode is not Dispatch.DP_COMPUTE_PROTO or cmd.out_url is None:
                    raise TypeError(
                        f"{method} ({mode.value}) returned a DataProto; only "
                        "DP_COMPUTE_PROTO methods may return one"
                    )
                if not layout.is_output_rank:
                    return Reply(id=cmd.id, ok=True, kind="dropped", layout=layout)
                result.save(cmd.out_url)
                rules = metric_rules_of(self.cls, method)
                return Reply(
                    id=cmd.id,
                    ok=True,
                    kind="dataproto",
                    result=cmd.out_url,
                    metric_rules=rules,
                    layout=layout,
                )
            json.dumps(result)  # fail here, with a traceback, if the result is not JSON
            return Reply(id=cmd.id, ok=True, kind="json", result=result, layout=layout)
        except BaseException as e:
            if isinstance(e, SystemExit):
                raise
            failure = _failure(e)
            print(
                f"[ppoflow] rank {self.rank}: {method} raised\n{failure.traceback}",
                file=sys.stderr,
                flush=True,
            )
            known = _layout(self.worker) if self.worker is not None else None
            return Reply(id=cmd.id, ok=False, failure=failure, layout=known)

    def shutdown(self, cmd: Shutdown) -> None:
        """Run the worker's shutdown hook, free it, tear down torch.distributed, exit fast."""
        err = None
        try:
            if self.worker is not None and hasattr(self.worker, "shutdown"):
                self.worker.shutdown()
        except BaseException:  # noqa: BLE001 - still exit
            err = traceback.format_exc()
            print(f"[ppoflow] rank {self.rank}: worker.shutdown raised\n{err}", file=sys.stderr)
        self.worker = None
        gc.collect()
        try:
            dist.barrier()
            dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            err = err or traceback.format_exc()
        try:
            failure = Failure(error=err) if err is not None else None
            send(self.conn, Reply(id=cmd.id, ok=err is None, failure=failure))
        except OSError:
            pass

    def serve(self) -> None:
        """Receive commands until shutdown; exit (status 1) if the driver's connection closes."""
        while True:
            try:
                cmd = receive(self.conn, Call, Shutdown)
            except (EOFError, OSError):
                _orphaned(f"rank {self.rank}: the driver closed its link")
            if isinstance(cmd, Shutdown):
                self.shutdown(cmd)
                return
            else:
                send(self.conn, self.call(cmd))


def main() -> None:
    """Initialise torch.distributed, connect to the driver, build the worker, serve commands."""
    env = os.environ
    threading.Thread(
        target=_watch_driver, args=(int(env["PPOFLOW_DRIVER_PID"]),), name="ppoflow-driver-watch", daemon=True
    ).start()
    injected = faults.rank_entries()
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    threads = int(env.get("PPOFLOW_RANK_THREADS") or max(1, (os.cpu_count() or 1) // local_world))
    torch.set_num_threads(threads)
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if env.get("PPOFLOW_DEVICE", "cpu") == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group(backend="gloo")
    host, _, port = env["PPOFLOW_DRIVER_ADDR"].rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(env["PPOFLOW_AUTHKEY"]))
    hello = Hello(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        pid=os.getpid(),
        group=env.get("PPOFLOW_GROUP_ID", ""),
        node=int(env.get("PPOFLOW_NODE_RANK") or 0),
        host=socket.gethostname(),
    )
    send(conn, hello)
    server = RankServer(conn, env["PPOFLOW_WORKER"], injected)
    server.build(dict(receive(conn, Init).config))
    server.serve()
    _end()


def _end() -> None:
    """After a clean shutdown. A spawned rank exits at once (``os._exit``: no interpreter teardown
    that a library's leftover thread could hold up). A rank forked by the launcher returns, so that
    torch's launcher collects its result; a daemon timer ends it should a leftover non-daemon
    thread hold the interpreter's exit."""
    if multiprocessing.parent_process() is None:
        _flush_and_exit(0)
    _flush()
    timer = threading.Timer(EXIT_GRACE_S, _flush_and_exit, args=(0,))
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    main()
