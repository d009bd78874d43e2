"""What one flow run keeps across its iterations: the worker groups, the dataset, the tokenizer.

Prefect task parameters must be hashable, JSON-able values, so tasks never receive a live
``WorkerGroup``: the flow opens a :class:`RunContext` under a string key (its flow run id) and
passes the key; each task looks the context up with :func:`get_run`.

Worker groups start lazily, when a task first needs them, and live until :func:`close_run`
(the flow's ``finally``). Each group slot records which checkpoint its live module equals
(``state``): a task names the state it needs, e.g. ``generate`` of iteration n needs the actor of
``checkpoints/actor/{n-1}``; a group in another state loads it; a dead group (a rank died) is
rebuilt — a fresh group, ``init_model``, ``load_checkpoint`` — so a task's retry resumes from the
right weights and optimizer state. A task holds its role's slot (:meth:`RunContext.hold`) from its
first use of the group to its end, so tasks of consecutive iterations (which overlap: commit n
waits for checkpoint n while iteration n+1 runs) never change a group's state under each other.

Checkpoints written in the background are tracked in :attr:`RunContext.writes`
(:mod:`ppoflow.tasks.checkpoints`). A state that is such a checkpoint, lost before it was complete
(its group died, or its write failed), is recomputed from its lineage when a group needs it
(:meth:`RunContext.materialize`): load the previous checkpoint, rerun the update, save.

With ``resources.launch: rendezvous`` the groups' ranks run on ``rendezvous.nnodes`` nodes: the
context opens the run's :class:`~ppoflow.infra.remote.driver.hub.ClusterHub` (the control endpoint
the nodes' ``ppoflow agent`` processes dial, and the c10d rendezvous store) with the first group,
gives every group (and every rebuild) its own rendezvous id ``<run>-<role>-<start>`` and a scratch
space under ``<experiment>/scratch/``, and closes the hub after the groups at the end of the run.

Rank output goes to the Prefect logger of the task currently using the group (see
:meth:`RunContext.using`), else to the flow's logger.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ppoflow.infra.checkpoint.marker import CheckpointError, IncompleteCheckpointError, is_complete
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra import faults
from ppoflow.infra.remote.driver.hub import ClusterHub
from ppoflow.infra.remote.cluster_key import load_cluster_key
from ppoflow.infra.remote.dispatch import Dispatch, registered_methods
from ppoflow.infra.remote.driver.group import RankFailure, WorkerGroup, WorkerGroupDead
from ppoflow.infra.remote.driver.launchers import Launcher
from ppoflow.infra.remote.driver.rendezvous import RendezvousLauncher
from ppoflow.tasks.checkpoints import Writes
from ppoflow.workers.actor_rollout_ref_worker import ActorRolloutRefWorker
from ppoflow.infra.remote.rank.worker import Worker
from ppoflow.workers.critic_worker import CriticWorker
from ppoflow.workers.reward_model_worker import RewardModelWorker

__all__ = [
    "RunContext",
    "RunClosed",
    "WorkerHandle",
    "open_run",
    "get_run",
    "close_run",
    "abort_run",
    "worker_groups",
    "WORKERS",
    "ROLE_NAMES",
]

#: The worker class of each group, by the name tasks use for it.
WORKERS: dict[str, type[Worker]] = {
    "actor": ActorRolloutRefWorker,
    "critic": CriticWorker,
    "reward_model": RewardModelWorker,
}
#: The ``role`` each group's worker is built with.
ROLE_NAMES = {"actor": "actor_rollout_ref", "critic": "critic", "reward_model": "reward_model"}

_LOG = logging.getLogger("ppoflow.flow")


class RunClosed(WorkerGroupDead):
    """The run's worker groups were shut down (the flow is ending): no group starts again."""


class WorkerHandle:
    """The driver's view of one role's worker group: an attribute per ``@register`` method of its
    worker class, so ``handle.compute_values(url, out_url=...)`` is checked against the class's
    table (a typo fails at once, naming the methods there are) and goes to ``RunContext.call``.

    DP_COMPUTE_PROTO methods take the input DataProto's URL and return the output's URL (or the
    per-rank JSON results); ONE_TO_ALL methods return the per-rank results; RANK_ZERO rank 0's.
    """

    def __init__(self, ctx: RunContext, role: str):
        self._ctx, self._role, self._cls = ctx, role, WORKERS[role]
        self._methods = registered_methods(self._cls)

    def __getattr__(self, method: str) -> Callable[..., Any]:
        mode = self.__dict__.get("_methods", {}).get(method)
        if mode is None:
            raise AttributeError(
                f"{self._cls.__name__} (the {self._role} group) has no @register method {method!r}; "
                f"it has {', '.join(sorted(self._methods))}"
            )
        return functools.partial(self._ctx.call, self._role, method)

    def mode(self, method: str) -> Dispatch:
        """The dispatch mode of ``method``."""
        return self._methods[method]

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))


@dataclass
class _Slot:
    """One worker group of the run and the checkpoint its live module equals (None: unknown)."""

    group: WorkerGroup | None = None
    state: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: threading.RLock = field(default_factory=threading.RLock)  # by the task using the group
    starts: int = 0


class RunContext:
    """Flow-run-scoped state shared by the tasks (see the module docstring)."""

    def __init__(self, key: str, cfg: ExperimentConfig, log: Any = None):
        self.key, self.cfg = key, cfg
        self.paths = ExperimentPaths.of(cfg)
        self.log = log or _LOG
        self.lock: Any = None  # the ExperimentLock, set by the flow
        self._slots = {role: _Slot() for role in WORKERS}
        self._sinks: dict[str, Any] = {}
        self._dataset: Any = None
        self._tokenizer: Any = None
        self._mutex = threading.Lock()
        self._hub: ClusterHub | None = None
        self._hub_lock = threading.Lock()
        self.writes = Writes(timeout_s=cfg.checkpoint.wait_timeout_s)
        self.closed = False

    # ------------------------------------------------------------------ data
    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (loaded once per run)."""
        with self._mutex:
            return self._load_tokenizer()

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.cfg.model.tokenizer, trust_remote_code=self.cfg.model.trust_remote_code
            )
        return self._tokenizer

    @property
    def dataset(self) -> Any:
        """The prompt dataset (read once per run)."""
        with self._mutex:
            if self._dataset is None:
                from ppoflow.infra.data.prompts import PromptDataset

                data = self.cfg.data
                dataset = PromptDataset(
                    data.train_files,
                    prompt_key=data.prompt_key,
                    require_ground_truth=self.cfg.reward.rule,
                    storage_options=self.cfg.storage.storage_options or None,
                )
                if data.filter_overlong_prompts:
                    dataset.filter_overlong(
                        self._load_tokenizer(),
                        prompt_length=self.cfg.rollout.prompt_length,
                        apply_chat_template=data.apply_chat_template,
                    )
                self._dataset = dataset
            return self._dataset

    # ------------------------------------------------------------------ logs
    def _emit(self, role: str, line: str) -> None:
        sink = self._sinks.get(role) or self.log
        try:
            sink.info(line)
        except Exception:  # noqa: BLE001 - a closed task logger must not kill the output pump
            _LOG.info(line)

    @contextlib.contextmanager
    def using(self, role: str, logger: Any) -> Iterator[None]:
        """Route ``role``'s rank output to ``logger`` (a task's run logger) inside the block."""
        self._sinks[role] = logger
        try:
            yield
        finally:
            self._sinks.pop(role, None)

    # ------------------------------------------------------------------ groups
    def group(
        self, role: str, state: str | None = None, *, progress: Callable[[str], None] | None = None
    ) -> WorkerGroup:
        """The live group of ``role``, started or rebuilt if needed, holding checkpoint ``state``.

        ``state=None`` accepts any state (e.g. ref log-probs use the fixed reference weights).
        """
        if self.closed:
            raise RunClosed(f"run {self.key} is closed; its worker groups were shut down")
        slot = self._slots[role]
        with slot.lock:
            if slot.group is None or not slot.group.alive:
                self._start(role, slot, progress)
            if state is not None and slot.state != state:
                self._load(role, slot, state, progress or self.log.info)
            return slot.group

    def _load(self, role: str, slot: _Slot, state: str, progress: Callable[[str], None]) -> None:
        """Make ``role``'s live module equal checkpoint ``state`` (``slot.lock`` held): wait for
        this run's background write of it, or recompute it from its lineage if it was lost."""
        problem = self.writes.wait(state)
        lineage = self.writes.lineage(state)
        if problem is not None and lineage is not None and not is_complete(state):
            faults.note_rank_failure(faults.CHECKPOINT_WRITE)
            progress(
                f"checkpoint {state} was lost before it was complete ({problem}); recomputing it: "
                f"load {lineage.previous}, run {lineage.method} again on the same batch, save"
            )
            if slot.state != lineage.previous:
                self._load(role, slot, lineage.previous, progress)
            slot.state = None
            self.call(role, lineage.method, lineage.data_url)
            self.call(role, "save_checkpoint", state, extra=lineage.extra)
            self.writes.started(lineage, slot.group, background=False)
        else:
            self.call(role, "load_checkpoint", state)
        slot.state = state

    def materialize(self, role: str, url: str, progress: Callable[[str], None] | None = None) -> None:
        """Make sure checkpoint ``url`` of ``role`` is complete on storage: wait for its background
        write; if that was lost, save it from the live module when the group still holds it, else
        recompute it from its lineage. Holds the role (no task uses the group meanwhile)."""
        say = progress or self.log.info
        problem = self.writes.wait(url)
        if problem is None:
            return
        lineage = self.writes.lineage(url)
        if lineage is None:
            raise IncompleteCheckpointError(f"checkpoint {url} is not complete: {problem}")
        faults.note_rank_failure(faults.CHECKPOINT_WRITE)
        with self.hold(role):
            slot = self._slots[role]
            with slot.lock:
                if is_complete(url):
                    return
                if slot.group is not None and slot.group.alive and slot.state == url:
                    say(f"checkpoint {url}: {problem}; saving it again from the live {role} group")
                    self.call(role, "save_checkpoint", url, extra=lineage.extra)
                    self.writes.started(lineage, slot.group, background=False)
                    return
            self.group(role, url, progress=say)  # recomputes it (see _load)
        if not is_complete(url):
            raise CheckpointError(f"checkpoint {url} is still not complete after recomputing it")

    @contextlib.contextmanager
    def hold(self, role: str) -> Iterator[None]:
        """Hold ``role``'s group for the calling task (re-entrant)."""
        with self._slots[role].held:
            yield

    def acquire(self, role: str) -> None:
        """:meth:`hold` without a block (the task's wrapper releases it with :meth:`release`)."""
        self._slots[role].held.acquire()

    def release(self, role: str) -> None:
        self._slots[role].held.release()

    def current_group(self, role: str) -> WorkerGroup | None:
        """The live group object of ``role`` (None if not started)."""
        return self._slots[role].group

    def worker(
        self, role: str, state: str | None = None, *, progress: Callable[[str], None] | None = None
    ) -> WorkerHandle:
        """:meth:`group` as a :class:`WorkerHandle` (the methods of ``role``'s worker class)."""
        self.group(role, state, progress=progress)
        return WorkerHandle(self, role)

    def prestart(self, roles: list[str]) -> None:
        """Start the groups of ``roles`` in background threads (their starts overlap each other
        and the first tasks); a task that needs one waits for it. A failed start is only logged
        here: the task that needs the group starts it again and reports the error."""

        def start(role: str) -> None:
            try:
                self.group(role, None)
            except Exception as exc:  # noqa: BLE001 - the task retries and raises
                self.log.warning(f"starting the {role} group in the background failed: {exc}")

        for role in roles:
            slot = self._slots[role]
            if slot.group is None or not slot.group.alive:
                threading.Thread(
                    target=start, args=(role,), name=f"ppoflow-start-{role}", daemon=True
                ).start()

    def _start(self, role: str, slot: _Slot, progress: Callable[[str], None] | None) -> None:
        if slot.group is not None:
            slot.group.shutdown()
        cfg = self.cfg
        config = {"config": cfg.model_dump(mode="json"), "role": ROLE_NAMES[role]}
        worker = WORKERS[role]
        slot.starts += 1
        launcher = self._launcher(role, slot.starts)
        group = WorkerGroup(
            f"{worker.__module__}:{worker.__qualname__}",
            nprocs=cfg.resources.nprocs,
            config=config,
            device=cfg.resources.device,
            log=lambda line: self._emit(role, line),
            env=self._rank_env(),
            launcher=launcher,
            start_timeout_s=max(120.0, cfg.resources.rendezvous.join_timeout_s) if launcher else 120.0,
        )
        slot.group, slot.state = group, None
        (progress or self.log.info)(
            f"starting the {role} worker group ({group.launcher.describe()}, "
            f"{cfg.resources.device}, start #{slot.starts})"
        )
        try:
            group.start()
            infos = group.call("init_model")
            engine = infos[0].get("rollout") if infos and isinstance(infos[0], dict) else None
            if engine:  # how the engine settled (CUDA graphs, KV budget, sleep level) in the run's log
                self.log.info(f"{role} group: rollout engine {json.dumps(engine, sort_keys=True)}")
        except RankFailure as exc:
            faults.note_rank_failure(exc.method)
            slot.group = None
            raise

    def _launcher(self, role: str, start: int) -> Launcher | None:
        """None (a local group) or the rendezvous launcher of ``role``'s ``start``-th group."""
        res = self.cfg.resources
        if res.launch == "local":
            return None
        gid = f"{self.key.replace('-', '')[:8]}-{role.replace('_', '')}-{start}"
        return RendezvousLauncher(
            self.cluster_hub(),
            res.rendezvous.nproc_per_node,
            gid,
            storage.join(self.paths.root, "scratch", gid),
            join_timeout_s=res.rendezvous.join_timeout_s,
        )

    def cluster_hub(self) -> ClusterHub:
        """The run's control endpoint for node agents (opened on first use)."""
        with self._hub_lock:
            if self._hub is None:
                nodes = self.cfg.resources.rendezvous
                self._hub = ClusterHub(
                    load_cluster_key(who="a flow run with resources.launch: rendezvous"),
                    nnodes=nodes.nnodes,
                    advertise_host=nodes.driver_host or socket.getfqdn(),
                    bind_host=nodes.bind_host,
                    control_port=nodes.control_port,
                    rdzv_port=nodes.rdzv_port,
                    log=lambda line: self._emit("", line),
                )
                self.log.info(
                    f"waiting for {nodes.nnodes} node agents: run `ppoflow agent --driver "
                    f"{self._hub.control_address} --node-rank N` on each node (c10d rendezvous store "
                    f"at {self._hub.rdzv_endpoint})"
                )
            return self._hub

    def _rank_env(self) -> dict[str, str]:
        env = faults.rank_fault_env()
        if self.cfg.resources.threads_per_rank:
            env["PPOFLOW_RANK_THREADS"] = str(self.cfg.resources.threads_per_rank)
        return env

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``WorkerGroup.call`` on ``role``'s group; a rank failure drops the group (the next
        :meth:`group` rebuilds it) and re-raises."""
        slot = self._slots[role]
        if slot.group is None:
            raise WorkerGroupDead(f"the {role} group is not running; call group({role!r}) first")
        try:
            return slot.group.call(method, *args, **kwargs)
        except (RankFailure, WorkerGroupDead) as exc:
            if self.closed:  # killed by an interrupt: not a failure a retry should see
                raise RunClosed(f"run {self.key} was stopped while {role}.{method} ran") from exc
            faults.note_rank_failure(getattr(exc, "method", None) or method)
            slot.group, slot.state = None, None
            raise

    def set_state(self, role: str, state: str | None) -> None:
        """Record that ``role``'s live module now equals checkpoint ``state`` (None: unknown)."""
        self._slots[role].state = state

    def state(self, role: str) -> str | None:
        return self._slots[role].state

    def starts(self, role: str) -> int:
        """How many times ``role``'s group was started in this run (rebuilds included)."""
        return self._slots[role].starts

    def kill(self) -> None:
        """Kill every group now, without waiting for calls in flight (an interrupt); idempotent."""
        self.closed = True
        for role, slot in self._slots.items():
            group = slot.group
            if group is not None:
                try:
                    group.kill("the run was interrupted")
                except Exception as exc:  # noqa: BLE001 - keep killing the others
                    _LOG.warning("killing the %s group failed: %s", role, exc)

    def shutdown(self) -> None:
        """Shut every group down, in parallel (idempotent)."""
        self.closed = True

        def stop(role: str, slot: _Slot) -> None:
            with slot.lock:
                if slot.group is not None:
                    try:
                        slot.group.shutdown()
                    except Exception as exc:  # noqa: BLE001 - keep shutting the others down
                        _LOG.warning("shutting down the %s group failed: %s", role, exc)
                    slot.group = None

        threads = [
            threading.Thread(target=stop, args=item, name=f"ppoflow-stop-{item[0]}")
            for item in self._slots.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._hub_lock:
            hub, self._hub = self._hub, None
        if hub is not None:  # after the groups: the agents kill anything left, wait for the next run
            try:
                hub.close()
            except Exception as exc:  # noqa: BLE001 - the run's outcome does not depend on it
                _LOG.warning("closing the cluster hub failed: %s", exc)


_RUNS: dict[str, RunContext] = {}
_RUNS_LOCK = threading.Lock()


def open_run(key: str, cfg: ExperimentConfig, log: Any = None) -> RunContext:
    """Create the context of flow run ``key`` (and set the storage options of its protocol)."""
    if cfg.storage.storage_options:
        proto = cfg.storage.root.split("://", 1)[0] if "://" in cfg.storage.root else "file"
        storage.set_default_storage_options(proto, cfg.storage.storage_options)
    with _RUNS_LOCK:
        if key in _RUNS and not _RUNS[key].closed:
            raise RuntimeError(f"flow run {key} already has an open context")
        ctx = _RUNS[key] = RunContext(key, cfg, log)
        return ctx


def get_run(key: str) -> RunContext:
    """The context of flow run ``key``; a clear error if the flow did not open it."""
    try:
        return _RUNS[key]
    except KeyError:
        raise RuntimeError(
            f"no open ppoflow run {key!r}: ppoflow tasks run inside the `ppo` flow, "
            f"which opens the run's worker groups"
        ) from None


def close_run(key: str) -> None:
    """Shut the run's groups down and forget it."""
    with _RUNS_LOCK:
        ctx = _RUNS.pop(key, None)
    if ctx is not None:
        ctx.shutdown()


def abort_run(key: str) -> None:
    """Kill the run's groups at once (an interrupt); :func:`close_run` still forgets the run."""
    with _RUNS_LOCK:
        ctx = _RUNS.get(key)
    if ctx is not None:
        ctx.kill()


@contextlib.contextmanager
def worker_groups(key: str) -> Iterator[None]:
    """The span in which run ``key``'s worker groups may live: at its end they are shut down
    cleanly; on an interrupt (Ctrl-C, SIGTERM: a ``BaseException`` that is not an ``Exception``)
    they are killed first, so a task blocked on a rank cannot delay the exit."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            abort_run(key)
        raise
    finally:
        close_run(key)
