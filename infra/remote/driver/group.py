"""WorkerGroup: a persistent group of N ranks (torchrun) running one worker class, driven by JSON
commands from the driver process (a Prefect task, a test, a script).

    with WorkerGroup("ppoflow.workers.critic_worker:CriticWorker", nprocs=2, config=cfg,
                     device="cpu", log=logger.info) as group:
        group.call("init_model")                               # -> [rank0 result, rank1 result]
        url = group.call("compute_values", rollout_url, out_url=values_url, micro_batch=4)
        group.typed(CRITIC_ROLE).compute_values(rollout_url, out_url=values_url)   # mypy-checked

- ``start()`` has the group's launcher (:mod:`~ppoflow.infra.remote.driver.launchers`: torchrun
  on this host, or per-node agents with a c10d rendezvous) start the ranks; each connects back,
  says hello, receives the worker's config and builds the worker (imported by its "module:Class"
  string in the rank only). The messages are :mod:`ppoflow.infra.remote.protocol`'s.
- Rank output (stdout and stderr, prefixed ``[rankN]:``) goes line by line to ``log``.
- ``call`` sends one command per rank and waits for every reply
  (:mod:`~ppoflow.infra.remote.driver.replies`). Data never travels on the link: a
  DP_COMPUTE_PROTO call moves DataProto chunks as Arrow files in the group's scratch space (a
  temp dir, or a storage URL every node reads when ranks span hosts;
  :mod:`~ppoflow.infra.remote.driver.dp_split`).
- Failures: a rank that raises or dies gets the group killed and ``RankFailure`` raised within
  about a second; later calls raise ``WorkerGroupDead``. A start that fails (ranks that do not all
  connect within ``start_timeout_s``, or end first) raises ``GroupCannotStart`` when a new start
  would fail the same way (:mod:`~ppoflow.infra.remote.driver.group_start`). Ranks exit by
  themselves when the driver (or their node's agent) dies; a finalizer kills a group that was
  never shut down.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

from ppoflow.infra.data import storage
from ppoflow.infra.remote.contracts import Role
from ppoflow.infra.remote.dispatch import Dispatch
from ppoflow.infra.remote.driver.dp_split import merge_results, remove_chunks, split_proto
from ppoflow.infra.remote.driver.group_start import accept_ranks, classify
from ppoflow.infra.remote.driver.handle import typed_handle
from ppoflow.infra.remote.driver.launchers import Launcher, LocalLauncher
from ppoflow.infra.remote.driver.replies import ReplyCollector, log_shutdown_errors
from ppoflow.infra.remote.errors import GroupCannotStart, RankFailure, WorkerGroupDead
from ppoflow.infra.remote.protocol import (
    Call,
    Hello,
    Init,
    Layout,
    ProtocolError,
    Ready,
    Reply,
    Shutdown,
    send,
)

__all__ = ["WorkerGroup", "RankFailure", "GroupCannotStart", "WorkerGroupDead", "Dispatch"]

_LOG = logging.getLogger("ppoflow.ranks")
C = TypeVar("C")
R = TypeVar("R")
P = ParamSpec("P")
#: After a rank died, how long to wait for the launcher's account of it (torchrun's report, a lost
#: node) before killing the group: a forked rank's report is formatted by torch's logging, which
#: imports part of torch._dynamo the first time (about 1.2 s of a busy CPU).
SETTLE_S = 3.0


class _Resources:
    """What must be released when a group ends, shut down or not (held by a weakref finalizer):
    the launcher (processes, listener, scratch space) and the rank links."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.conns: list[Connection] = []

    def release(self) -> None:
        """Kill what is left, close the links, remove the scratch space (idempotent)."""
        self.launcher.release()
        for conn in self.conns:
            conn.close()
        self.conns = []


class WorkerGroup:
    """N ranks of ``worker`` ("module:Class": a :class:`~ppoflow.infra.remote.rank.worker.Worker`) under torchrun.

    Args:
        worker: import path "module:Class" of the worker (imported in the ranks only).
        nprocs: number of ranks (one per GPU on CUDA).
        config: JSON-able dict given to the worker's constructor (sent over the link, not env).
        device: "cpu" (gloo) or "cuda" (nccl).
        log: called with every output line of the ranks and torchrun (default: ``ppoflow.ranks``'s INFO).
        env: extra environment variables for the ranks (e.g. ``PPOFLOW_FAULT``).
        scratch_dir: parent of the default launcher's temp dir (chunks, rank logs; removed at shutdown).
        grace_s: after a rank raises, how long to wait for the other ranks before killing them.
        start_timeout_s: how long ``start`` waits for all ranks to connect.
        call_timeout_s: optional limit for one call (None: wait as long as the ranks live).
        launcher: how the ranks start (``ppoflow.infra.remote.driver.launchers``; default: this host's).
    """

    def __init__(
        self,
        worker: str,
        nprocs: int,
        config: dict[str, Any] | None = None,
        device: str = "cpu",
        log: Callable[[str], None] | None = None,
        env: dict[str, str] | None = None,
        scratch_dir: str | None = None,
        grace_s: float = 5.0,
        start_timeout_s: float = 120.0,
        call_timeout_s: float | None = None,
        launcher: Launcher | None = None,
    ):
        if ":" not in worker:
            raise ValueError(f"worker must be 'module:Class', got {worker!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        launcher = launcher or LocalLauncher(nprocs, scratch_dir)
        if launcher.nprocs != nprocs:
            raise ValueError(f"nprocs={nprocs} but the launcher starts {launcher.nprocs} ranks")
        self.worker, self.nprocs, self.device = worker, int(nprocs), device
        self.config = dict(config or {})
        self._init = Init(config=self.config)  # fails early on a config that is not JSON
        self.log = log or _LOG.info
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.grace_s = float(grace_s)
        self.start_timeout_s, self.call_timeout_s = float(start_timeout_s), call_timeout_s
        self.launcher = launcher
        self.pids: list[int] = []  # rank pids, by rank (from the hellos)
        self.hellos: dict[int, Hello] = {}  # rank -> its hello (pid, node, host, ...)
        self.methods: dict[str, Dispatch] = {}  # the worker class's @register table, from the ranks
        self.layout: list[Layout] = []  # per rank: dp_rank, dp_size, is_output_rank
        self.start_s: float | None = None
        self._res = _Resources(launcher)
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._state = "new"  # new -> running -> failed | closed
        self._dead_reason = ""

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        """True while the group is started, not failed nor shut down, and its processes run."""
        return self._state == "running" and self.launcher.failure() is None

    @property
    def scratch(self) -> str | None:
        """The group's scratch space: a temp dir or a storage URL (removed at shutdown)."""
        return self.launcher.scratch

    @property
    def launcher_pid(self) -> int | None:
        """Pid of the local torchrun process (None for groups whose ranks run elsewhere)."""
        return getattr(self.launcher, "pid", None)

    def output_tail(self, n: int = 200) -> str:
        """The last ``n`` output lines of the ranks and torchrun."""
        return self.launcher.output_tail(n)

    def start(self) -> WorkerGroup:
        """Launch the ranks, accept the N rank links, send the config, wait until every worker is built."""
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"WorkerGroup.start() on a group that is {self._state}")
            self._state = "running"
            try:
                self._start()
            except BaseException:
                if self._state == "running":  # a RankFailure from _fail() already killed it
                    self._die("a failed start")
                raise
            return self

    def _start(self) -> None:
        """The body of ``start``: any exception leaves the caller to kill the group."""
        t0 = time.monotonic()
        self.launcher.start(self.worker, self.device, self.env, self.log)
        try:
            self.hellos = accept_ranks(
                self.launcher, self.nprocs, self.start_timeout_s, self._fail, self._res.conns
            )
            self.pids = [self.hellos[r].pid for r in range(self.nprocs)]
            placement = self.launcher.placement(self.hellos)
            if placement:
                self.log(f"[ppoflow] {placement}")
            for conn in self._res.conns:
                send(conn, self._init)
            ready = self._collect("__init__", None)
        except RankFailure as exc:  # the group is dead already (``_fail``)
            raise classify(exc, self.output_tail()) from None
        first = ready[0]
        assert isinstance(first, Ready)
        self.methods = {k: Dispatch(v) for k, v in first.methods.items()}
        self._update_layout(ready)
        self.start_s = time.monotonic() - t0

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Ask the ranks to exit cleanly (worker.shutdown(), free, barrier, destroy the process
        group, os._exit(0)); kill whatever is left after ``timeout_s``; remove the scratch space.
        Idempotent; safe on a failed group."""
        with self._lock:
            if self._state == "running" and self.alive:
                cid = next(self._ids)
                try:
                    for conn in self._res.conns:
                        send(conn, Shutdown(id=cid))
                    exited = self.launcher.wait(timeout_s)
                except OSError:
                    exited = False
                if not exited:
                    self.log(f"[ppoflow] ranks did not exit within {timeout_s} s; killing them")
                log_shutdown_errors(self._res.conns, self.log)
            if self._state in ("new", "running"):
                self._state, self._dead_reason = "closed", "it was shut down"
            self._finalizer()

    def kill(self, reason: str = "it was killed") -> None:
        """Kill the ranks now (SIGKILL, no clean exit), without waiting for a call in flight on
        another thread: that call fails at once (its links close). For interrupts (Ctrl-C,
        SIGTERM), where a clean :meth:`shutdown` would wait for the call to finish. Idempotent."""
        if self._state in ("new", "running"):
            self._state, self._dead_reason = "failed", reason
        self._res.release()

    def __enter__(self) -> WorkerGroup:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ calls
    def call(
        self, method: str, *args: Any, out_url: str | None = None, dp_blocks: int | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` on the ranks according to its dispatch mode.

        ONE_TO_ALL -> list of per-rank JSON results; RANK_ZERO -> rank 0's result;
        DP_COMPUTE_PROTO: ``call(method, data_url, *json_args, out_url=..., **json_kwargs)`` ->
        ``out_url`` where the merged DataProto was saved (default: a file in the scratch dir,
        deleted at shutdown), or the list of per-rank JSON results if the method returns dicts;
        ``dp_blocks``: split by blocks of rows instead of consecutive chunks (``split_proto``).
        Raises ``RankFailure`` (group killed) if a rank raises or dies, ``WorkerGroupDead`` on a
        dead group, ``AttributeError`` (group kept) for an unregistered method."""
        with self._lock:
            if self._state != "running":
                raise WorkerGroupDead(self._dead_message())
            cause = self.launcher.failure()
            if cause is not None:
                self._fail(cause, None, method, with_tail=True)
            mode = self.methods.get(method)
            if mode is None:
                raise AttributeError(
                    f"{self.worker} has no method {method!r} registered with "
                    f"@register (registered: {', '.join(sorted(self.methods))})"
                )
            json.dumps([args, kwargs])  # a TypeError here leaves the group intact
            cid = next(self._ids)
            if mode is Dispatch.DP_COMPUTE_PROTO:
                return self._call_dp(cid, method, args, kwargs, out_url, dp_blocks)
            if out_url is not None or dp_blocks is not None:
                raise TypeError(
                    f"out_url and dp_blocks are for DP_COMPUTE_PROTO methods; {method} is {mode.value}"
                )
            msg = Call(id=cid, method=method, args=list(args), kwargs=kwargs)
            replies = self._round_trip(method, [msg] * self.nprocs)
            results = [replies[r].result for r in range(self.nprocs)]
            return results if mode is Dispatch.ONE_TO_ALL else results[0]

    def typed(self, role: Role[C]) -> C:
        """The group's methods as ``role``'s contract (its Protocol; ``typed_handle``)."""
        return typed_handle(role, self.methods, self.call)

    def call_if_idle(
        self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> tuple[bool, R | None]:
        """``method`` (a contract's: ``TrainedContract.checkpoint_write_status``) if no call is in
        flight: ``(True, result)``; else ``(False, None)`` at once (not waiting behind a long task)."""
        if not isinstance(getattr(method, "__ppoflow_dispatch__", None), Dispatch):
            raise TypeError(f"call_if_idle takes a contract's method, not {method!r}")
        inspect.signature(method).bind(self, *args, **kwargs)  # a TypeError sends nothing
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            call: Callable[..., R] = self.call
            return True, call(method.__name__, *args, **kwargs)
        finally:
            self._lock.release()

    def _call_dp(
        self, cid: int, method: str, args: tuple, kwargs: dict, out_url: str | None, blocks: int | None
    ) -> Any:
        """DP_COMPUTE_PROTO: split ``args[0]`` (a DataProto URL) by dp_rank, run, merge."""
        if not args or not isinstance(args[0], str):
            raise TypeError(
                f"{method} is DP_COMPUTE_PROTO: call it as "
                f"call({method!r}, data_url, *args, out_url=..., **kwargs)"
            )
        assert self.launcher.scratch is not None  # a running group's launcher has its scratch space
        call_dir = storage.join(self.launcher.scratch, f"call-{cid:06d}")
        try:
            split = split_proto(args[0], self.nprocs, self.layout, call_dir, blocks=blocks)
            layout = self.layout  # the layout the data was split with
            replies = self._round_trip(method, split.calls(cid, method, list(args[1:]), kwargs, call_dir))
            dest = out_url or storage.join(self.launcher.scratch, f"out-{cid:06d}.arrow")
            return merge_results(method, [replies[r] for r in range(self.nprocs)], layout, split, dest)
        finally:
            if self.launcher.scratch is not None:  # a failed group's launcher removed it all already
                remove_chunks(call_dir, self.log)

    def _round_trip(self, method: str, msgs: list[Call]) -> dict[int, Reply]:
        """Send one command per rank, collect every reply (raising RankFailure), update the layout."""
        try:
            for rank, (conn, msg) in enumerate(zip(self._res.conns, msgs)):
                try:
                    send(conn, msg)
                except OSError:
                    self._fail(
                        f"{self._rank_name(rank)} is gone (link closed)",
                        rank,
                        method,
                        with_tail=True,
                        settle=True,
                    )
            replies = self._collect(method, msgs[0].id)
        except RankFailure:
            raise
        except BaseException:  # e.g. KeyboardInterrupt / cancellation: ranks are mid-call
            self._die(f"an interrupted call of {method!r}")
            raise
        self._update_layout(replies)
        return {r: msg for r, msg in replies.items() if isinstance(msg, Reply)}

    def _collect(self, method: str, cid: int | None) -> dict[int, Reply | Ready]:
        """One reply per rank (:mod:`ppoflow.infra.remote.driver.replies`); a rank that raised or
        died fails the call (and kills the group) through :meth:`_fail`."""
        return ReplyCollector(
            self._res.conns, self.launcher, self.grace_s, self.call_timeout_s, self._fail, self._rank_name
        ).collect(method, cid)

    def _rank_name(self, rank: int) -> str:
        """``rank 1 (pid 123)``, with the node it ran on when the group spans nodes."""
        hello = self.hellos.get(rank)
        if hello is None:
            return f"rank {rank}"
        where = f", node {hello.node}" if self.launcher.names_nodes else ""
        return f"rank {rank} (pid {hello.pid}{where})"

    def _update_layout(self, replies: dict[int, Reply] | dict[int, Reply | Ready]) -> None:
        layout = [replies[r].layout for r in range(self.nprocs)]
        if any(entry is None for entry in layout):
            raise ProtocolError(f"a rank's reply carries no layout: {layout}")
        self.layout = [entry for entry in layout if entry is not None]

    # ------------------------------------------------------------------ failure
    def _fail(
        self,
        what: str,
        rank: int | None,
        method: str,
        with_tail: bool,
        settle: bool = False,
        error_types: tuple[str, ...] = (),
    ) -> NoReturn:
        """Kill the group, mark it dead and raise RankFailure(what [+ the launcher's account of
        it, e.g. the node that was lost] [+ output tail])."""
        if settle:  # let the launcher notice the dead rank (torchrun's report, a lost node)
            deadline = time.monotonic() + SETTLE_S
            while self.launcher.failure() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        cause = self.launcher.failure()  # before the kill below ends everything
        self._die(f"a failure in {method!r} (rank {rank})")
        message = what
        if cause is not None and cause not in what:
            message = f"{cause}\n{what}" if self.launcher.names_nodes else f"{what}\n{cause}"
        if with_tail:
            message += f"\n--- last output lines of the ranks/torchrun ---\n{self.output_tail()}"
        raise RankFailure(message, rank=rank, method=method, error_types=error_types)

    def _die(self, reason: str) -> None:
        """Mark the group dead and kill it (process group, links, scratch dir)."""
        self._state, self._dead_reason = "failed", reason
        self._res.release()

    def _dead_message(self) -> str:
        if self._state == "new":
            return "WorkerGroup not started: call start() (or use it as a context manager)"
        return (
            f"this WorkerGroup is dead after {self._dead_reason}; start a new WorkerGroup "
            f"(rebuilding from the last checkpoint)"
        )
