"""A flow run's worker groups: started when a task first needs one, kept across the run's
iterations, rebuilt after a rank died, each known to hold one checkpoint's state.

Each role (``actor``, ``critic``, ``reward_model``) has a slot recording which checkpoint its
group's live module equals (``state``): a task names the state it needs, e.g. ``generate`` of
iteration n needs the actor of ``checkpoints/actor/{n-1}``; a group in another state loads it; a
dead group is rebuilt — a fresh group, ``init_model``, ``load_checkpoint`` — so a task's retry
resumes from the right weights and optimizer state. A task holds its role's slot (:meth:`hold`)
from its first use of the group to its end, so tasks of consecutive iterations (which overlap:
commit n waits for checkpoint n while iteration n+1 runs) never change a group's state under
each other.

A state that is a checkpoint this run wrote in the background and lost before it was complete
(its group died, or its write failed) is recomputed from its lineage when a group needs it
(:meth:`RunGroups.materialize`): load the previous checkpoint, rerun the update, save.

A group that cannot start (:class:`~ppoflow.infra.remote.errors.GroupCannotStart`: its ranks
exited with an error before they all connected, or its worker class does not import) is not
started again in this run: the task that needs it fails at once with that cause, and is not
retried. A start in the background (:meth:`RunGroups.prestart`) that fails so is the run's one
attempt; the groups still starting when the run ends are killed, not waited for.

How a group is made (its worker class, environment, connect timeout, and where its ranks run,
one host or several nodes) is :mod:`ppoflow.tasks.run.making`'s. The flow process never imports
a worker class: a group is started from the class's import path (:data:`WORKERS`), its methods
come from the table its ranks send, typed by its role's contract (:meth:`RunGroups.worker`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from ppoflow.infra.checkpoint.marker import CheckpointError, IncompleteCheckpointError, is_complete
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.remote.contracts import (
    ROLES,
    Build,
    Role,
    TrainedContract,
    WorkerContract,
    WorkerMode,
    update_of,
)
from ppoflow.infra.remote.driver.group import WorkerGroup
from ppoflow.infra.remote.driver.handle import typed_handle
from ppoflow.infra.remote.errors import GroupCannotStart, RankFailure, WorkerGroupDead
from ppoflow.infra.runtime import faults
from ppoflow.tasks.checkpoints import Writes
from ppoflow.tasks.replay import committed_chain, replay_chain, state_iteration, update_blocks, verify_batch
from ppoflow.tasks.run.making import DEFAULT_BUILDS, WORKERS, GroupMaker

__all__ = ["RunGroups", "RunClosed", "WORKERS", "DEFAULT_BUILDS"]

Progress = Callable[[str], None]
C = TypeVar("C")

_LOG = logging.getLogger("ppoflow.flow")


class RunClosed(WorkerGroupDead):
    """The run's worker groups were shut down (the flow is ending): no group starts again."""


@dataclass
class _Slot:
    """One worker group of the run and the checkpoint its live module equals (None: unknown)."""

    group: WorkerGroup | None = None
    state: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: threading.RLock = field(default_factory=threading.RLock)  # by the task using the group
    starts: int = 0
    starting: bool = False  # group.start() and init_model in progress
    cannot_start: GroupCannotStart | None = None  # why this run does not start the group again


class RunGroups:
    """The worker groups of flow run ``key`` (see the module docstring). ``emit(role, line)``
    receives every output line of a role's ranks; ``log`` the run's own notes; ``roles`` overrides
    what a group's worker builds (e.g. ``{"actor": WorkerMode.ROLLOUT}``: policy and engine, no
    optimizer or reference, for an evaluation; a mode's wire form, ``"rollout"``, is read as it;
    ValueError for a mode the group's worker does not have)."""

    def __init__(
        self,
        key: str,
        cfg: ExperimentConfig,
        paths: ExperimentPaths,
        writes: Writes,
        emit: Callable[[str, str], None],
        log: Any,
        roles: Mapping[str, Build | WorkerMode | str] | None = None,
    ):
        self.key, self.cfg, self.paths, self.writes = key, cfg, paths, writes
        self._emit, self.log = emit, log
        chosen = {role: ROLES[role].build(build) for role, build in (roles or {}).items()}
        self.builds: dict[str, Build] = {**DEFAULT_BUILDS, **chosen}
        self._slots = {role: _Slot() for role in WORKERS}
        self.maker = GroupMaker(key, cfg, paths, emit, log)
        self._replays: dict[str, list[dict[str, float]]] = {}
        self.closed = False

    # ------------------------------------------------------------------ state
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
            assert slot.group is not None
            return slot.group

    @overload
    def worker(self, role: Role[C], state: str | None = None, *, progress: Progress | None = None) -> C: ...
    @overload
    def worker(
        self, role: str, state: str | None = None, *, progress: Progress | None = None
    ) -> WorkerContract: ...
    def worker(
        self, role: Role[Any] | str, state: str | None = None, *, progress: Progress | None = None
    ) -> Any:
        """:meth:`group` as its contract (``ACTOR_ROLE`` -> ``ActorContract``; a group's name: the
        methods every worker has; ``ppoflow.infra.remote.contracts``), calling :meth:`call`."""
        name = role if isinstance(role, str) else role.name
        return self._bind(name, self.group(name, state, progress=progress))

    def _bind(self, role: str, group: WorkerGroup | None) -> Any:
        """``group``'s methods as ``role``'s contract, each call through :meth:`call`."""
        assert group is not None
        return typed_handle(ROLES[role], group.methods, functools.partial(self.call, role))

    def _load(self, role: str, slot: _Slot, state: str, progress: Callable[[str], None]) -> None:
        """Make ``role``'s live module equal checkpoint ``state`` (``slot.lock`` held): wait for
        this run's background write of it, recompute it from its lineage if that write was lost,
        or rebuild it from the latest snapshot by replaying the stored updates since."""
        problem = self.writes.wait(state)
        lineage = self.writes.lineage(state)
        if problem is not None and lineage is None and not is_complete(state):
            self._replay(role, slot, state, progress)
            return
        worker: TrainedContract = self._bind(role, slot.group)
        if problem is not None and lineage is not None and not is_complete(state):
            faults.note_rank_failure(faults.CHECKPOINT_WRITE)
            progress(
                f"checkpoint {state} was lost before it was complete ({problem}); recomputing it: "
                f"load {lineage.previous}, run {lineage.method} again on the same batch, save"
            )
            if slot.state != lineage.previous:
                self._load(role, slot, lineage.previous, progress)
            slot.state = None
            update_of(worker, lineage.method)(
                lineage.data_url, dp_blocks=update_blocks(self.cfg, lineage.method)
            )
            worker.save_checkpoint(state, extra=lineage.extra)
            self.writes.started(lineage, slot.group, background=False)
        else:
            worker.load_checkpoint(state)
        slot.state = state

    def _replay(self, role: str, slot: _Slot, state: str, progress: Callable[[str], None]) -> None:
        """Rebuild ``state`` (not written: not a snapshot iteration) from the stored state its
        chain starts at, running its updates again (from the live module where it already holds a
        state of the chain); the seconds it took go to :meth:`take_replays`."""
        t0 = time.perf_counter()
        base, steps = replay_chain(self.paths, role, state)
        chain = [base, *(s.state for s in steps)]
        start = chain.index(slot.state) if slot.state in chain else 0
        worker: TrainedContract = self._bind(role, slot.group)
        if start == 0:
            worker.load_checkpoint(base)
            slot.state = base
        records = committed_chain(self.paths, role, state)
        for step in steps[start:]:
            verify_batch(self.paths, step, records)
            slot.state = None  # the live module is between states until the update returns
            update_of(worker, step.method)(step.batch, dp_blocks=update_blocks(self.cfg, step.method))
            slot.state = step.state
        seconds = time.perf_counter() - t0
        done = len(steps) - start
        self._replays.setdefault(role, []).append({"updates": done, "seconds": seconds})
        progress(
            f"rebuilt the {role}'s state of iteration {state_iteration(state)}: "
            + (f"loaded {self.paths.ref(base)}, " if start == 0 else "from the live group, ")
            + f"replayed {done} update(s) in {seconds:.1f} s"
        )

    def take_replays(self, role: str) -> dict[str, float]:
        """Metrics of the replays of ``role`` since the last call (``replay/<role>_updates``,
        ``timing_s/replay_<role>``), for the task that caused them."""
        done = self._replays.pop(role, [])
        if not done:
            return {}
        return {
            f"replay/{role}_updates": float(sum(r["updates"] for r in done)),
            f"timing_s/replay_{role}": float(sum(r["seconds"] for r in done)),
        }

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
                    worker: TrainedContract = self._bind(role, slot.group)
                    worker.save_checkpoint(url, extra=lineage.extra)
                    self.writes.started(lineage, slot.group, background=False)
                    return
            self.group(role, url, progress=say)  # recomputes it (see _load)
        if not is_complete(url):
            raise CheckpointError(f"checkpoint {url} is still not complete after recomputing it")

    def set_state(self, role: str, state: str | None) -> None:
        """Record that ``role``'s live module now equals checkpoint ``state`` (None: unknown)."""
        self._slots[role].state = state

    def state(self, role: str) -> str | None:
        return self._slots[role].state

    def starts(self, role: str) -> int:
        """How many times ``role``'s group was started in this run (rebuilds included)."""
        return self._slots[role].starts

    def current_group(self, role: str) -> WorkerGroup | None:
        """The live group object of ``role`` (None if not started)."""
        return self._slots[role].group

    # ------------------------------------------------------------------ holding
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

    # ------------------------------------------------------------------ starting
    def prestart(self, roles: list[str]) -> None:
        """Start the groups of ``roles`` in background threads (their starts overlap each other
        and the first tasks); a task that needs one waits for it. A failed start is only logged
        here (its first lines): the task that needs the group reports it, at once for a group
        that cannot start (:class:`GroupCannotStart`), else after starting the group again."""

        def start(role: str) -> None:
            try:
                self.group(role, None)
            except Exception as exc:  # noqa: BLE001 - the task raises it (or starts again)
                if not self.closed:  # else the run ended (and killed the start): nothing to say
                    head = str(exc).partition("\n--- ")[0]
                    self.log.warning(f"starting the {role} group in the background failed: {head}")

        for role in roles:
            slot = self._slots[role]
            if slot.group is None or not slot.group.alive:
                threading.Thread(
                    target=start, args=(role,), name=f"ppoflow-start-{role}", daemon=True
                ).start()

    def _start(self, role: str, slot: _Slot, progress: Callable[[str], None] | None) -> None:
        if slot.cannot_start is not None:  # the same start fails the same way: say why again
            raise slot.cannot_start
        if slot.group is not None:
            slot.group.shutdown()
        slot.starts += 1
        group = self.maker.group(role, self.builds[role], slot.starts)
        slot.group, slot.state, slot.starting = group, None, True
        (progress or self.log.info)(
            f"starting the {role} worker group ({group.launcher.describe()}, "
            f"{self.cfg.resources.device}, start #{slot.starts})"
        )
        try:
            group.start()
            problem = ROLES[role].mismatch(group.methods)  # another version of the worker
            if problem is not None:
                raise GroupCannotStart(f"{group.worker} does not keep the {role} contract: {problem}")
            infos = group.typed(ROLES[role]).init_model()
            engine = infos[0].get("rollout") if infos and isinstance(infos[0], dict) else None
            if engine:  # how the engine settled (CUDA graphs, KV budget, sleep level) in the run's log
                self.log.info(f"{role} group: rollout engine {json.dumps(engine, sort_keys=True)}")
        except GroupCannotStart as exc:
            faults.note_rank_failure(exc.method)
            group.kill(f"the {role} group cannot start")  # (it is dead already unless its contract failed)
            slot.group = None
            slot.cannot_start = GroupCannotStart(
                f"the {role} worker group cannot start: {exc}", exc.rank, exc.method, exc.error_types
            )
            raise slot.cannot_start from None
        except RankFailure as exc:
            faults.note_rank_failure(exc.method)
            slot.group = None
            raise
        finally:
            slot.starting = False

    # ------------------------------------------------------------------ calls
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

    # ------------------------------------------------------------------ the end
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
        """Shut every group down, in parallel, then the cluster hub (idempotent)."""
        self.closed = True

        def stop(role: str, slot: _Slot) -> None:
            with slot.lock:
                if slot.group is not None:
                    try:
                        slot.group.shutdown()
                    except Exception as exc:  # noqa: BLE001 - keep shutting the others down
                        _LOG.warning("shutting down the %s group failed: %s", role, exc)
                    slot.group = None

        for role, slot in self._slots.items():
            group = slot.group
            if slot.starting and group is not None:  # a start in the background: end it now
                group.kill(f"the run ended while the {role} group started")
        threads = [
            threading.Thread(target=stop, args=item, name=f"ppoflow-stop-{item[0]}")
            for item in self._slots.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:  # after the groups: the agents kill anything left, wait for the next run
            self.maker.close()
        except Exception as exc:  # noqa: BLE001 - the run's outcome does not depend on it
            _LOG.warning("closing the cluster hub failed: %s", exc)
