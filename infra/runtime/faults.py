"""Fault injection for chaos drills and tests: make a task fail, or a rank die, on purpose.

Set the environment variable ``PPOFLOW_FAULT`` in the process that runs the flow to a
comma-separated list of entries:

    task:<task>:before         the Prefect task <task> raises FaultInjected before doing any work
    task:<task>:after          ... after its output is written (the retry must find and reuse it)
    task:<task>@<n>:<point>    ... only in iteration <n>
    rank_exit:<method>:<rank>  rank <rank> of a worker group calls os._exit(17) when <method> starts
    rank_raise:<method>:<rank> rank <rank> raises RuntimeError when <method> starts
    node_exit:<method>:<rank>  the node running rank <rank> is lost when <method> starts: the rank
                               SIGKILLs its node's agent and goes down with it (groups of
                               ``resources.launch: rendezvous`` only)

Rank entries may also name a *point* inside a method instead of a method (:func:`rank_point`):

    rank_exit:checkpoint_write:<rank>   the rank exits while it writes a checkpoint: after its
                                        shards, before the marker (in the background writer)
    rank_raise:checkpoint_write:<rank>  the rank's storage write fails inside DCP (every rank sees
                                        it; the writer retries, see checkpoint.write_attempts)
    rank_raise:checkpoint_publish:0     rank 0 fails to publish the marker after every shard was
                                        written (as a full disk makes it fail)

``rank_skip:<point>:<rank>`` makes the rank skip a step instead of failing (:func:`rank_skips`):

    rank_skip:weight_push:<rank>        the rank's rollout engine keeps the weights it holds
                                        instead of loading the actor's before a rollout: it samples
                                        from stale weights (the first push of each rank process,
                                        or every one with ``:always``). The push is a collective on
                                        live weights: name every rank of the group

``kill:<point>:<n>`` SIGKILLs the flow process itself at a point of iteration (or rollout batch)
<n> (:func:`maybe_kill`): what a crashed machine does to a run, with nothing cleaned up.

    kill:publish:<n>                    the trainer dies while it publishes policy version <n>: its
                                        weights written, the pointer to them not yet moved
    kill:policy_load:<n>                the rollout producer dies while it loads a new policy
                                        version into its engine for batch <n>

A process started again by its parent (the rollout producer by the trainer) gets no ``kill``
entry (:func:`without_kills`).

``stall:<point>:<n>`` makes a flow process wait at a point of batch <n> (:func:`stalls`), once:

    stall:chunk:<n>                     the rollout producer, after the first chunk of batch <n>,
                                        waits until a newer policy version is published (a
                                        straggler: the rest of the batch spans a weight update)

Each entry fires once per process, so the task's retry (or the rebuilt group) passes. Append
``:always`` to an entry to make it fire every time (e.g. to exhaust a task's retries and fail the
flow run, then resume it with ``prefect flow-run retry`` or by running the flow again).

Task names: ``init``, ``generate``, ``ref_log_prob``, ``values``, ``rm_score``, ``advantage``,
``update_actor``, ``update_critic``, ``commit``. Worker methods are those of the worker classes
(``generate_sequences``, ``compute_log_prob``, ``update_actor``, ``compute_values``, ...).

    PPOFLOW_FAULT=task:advantage:after,rank_exit:update_actor:1 ppoflow run experiment.yaml

The rank entries reach the ranks through :func:`rank_fault_env` (the worker group's ``env``);
an entry is spent when a call of that method fails (:func:`note_rank_failure`), after which
rebuilt groups no longer receive it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = [
    "ENV_VAR",
    "CHECKPOINT_WRITE",
    "CHECKPOINT_PUBLISH",
    "FaultInjected",
    "Fault",
    "parse",
    "maybe_fail",
    "rank_fault_env",
    "note_rank_failure",
    "rank_entries",
    "rank_point",
    "rank_skips",
    "WEIGHT_PUSH",
    "reset",
    "maybe_kill",
    "stalls",
    "without_kills",
]

ENV_VAR = "PPOFLOW_FAULT"
#: The rank point fired when a rank opens a checkpoint file for writing (see ``rank_point``).
CHECKPOINT_WRITE = "checkpoint_write"
#: The rank point fired on rank 0 just before it publishes a checkpoint's marker.
CHECKPOINT_PUBLISH = "checkpoint_publish"
#: The rank point a rollout engine's weight push checks (see ``rank_skips``).
WEIGHT_PUSH = "weight_push"
TASK_POINTS = ("before", "after")
RANK_KINDS = ("rank_exit", "rank_raise", "node_exit", "rank_skip")
KILL = "kill"
STALL = "stall"

_fired: set[str] = set()
_lock = threading.Lock()


class FaultInjected(RuntimeError):
    """Raised by a task at a point named in ``PPOFLOW_FAULT`` (an intended, retryable failure)."""


@dataclass(frozen=True)
class Fault:
    """One parsed entry: ``kind`` is task / rank_exit / rank_raise; ``target`` the task or method;
    ``where`` the point (before/after) or the rank number as a string."""

    kind: str
    target: str
    where: str
    always: bool
    text: str

    @property
    def rank_spec(self) -> str:
        """The entry in the form the rank side understands."""
        return f"{self.kind}:{self.target}:{self.where}" + (":always" if self.always else "")

    def names(self, task: str, iteration: int | None) -> bool:
        """True when this (task) entry is aimed at ``task`` (in ``iteration``, if it names one)."""
        name, _, n = self.target.partition("@")
        return name == task and (not n or (iteration is not None and n == str(iteration)))


def parse(spec: str | None) -> list[Fault]:
    """Parse a ``PPOFLOW_FAULT`` value; ValueError naming the bad entry and the allowed forms."""
    faults = []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        parts = item.split(":")
        always = len(parts) == 4 and parts[3] == "always"
        if always:
            parts = parts[:3]
        name, at, n = parts[1].partition("@") if len(parts) > 1 else ("", "", "")
        ok = len(parts) == 3 and (
            (parts[0] == "task" and parts[2] in TASK_POINTS and bool(name) and (not at or n.isdigit()))
            or ((parts[0] in RANK_KINDS or parts[0] in (KILL, STALL)) and parts[2].isdigit())
        )
        if not ok:
            raise ValueError(
                f"{ENV_VAR}: bad entry {item!r}; allowed: task:<task>[@<iteration>]:before|after, "
                f"rank_exit:<method>:<rank>, rank_raise:<method>:<rank>, node_exit:<method>:<rank>, "
                "rank_skip:<point>:<rank>, kill:<point>:<n>, stall:<point>:<n> (each optionally + ':always')"
            )
        faults.append(Fault(parts[0], parts[1], parts[2], always, item))
    return faults


def _current() -> list[Fault]:
    return parse(os.environ.get(ENV_VAR))


def maybe_fail(task: str, point: str, iteration: int | None = None) -> None:
    """Raise :class:`FaultInjected` if ``PPOFLOW_FAULT`` names ``task`` at ``point`` (in
    ``iteration``, for entries that name one) and the entry has not fired yet in this process,
    unless it says ``:always``."""
    for fault in _current():
        if fault.kind == "task" and fault.names(task, iteration) and fault.where == point:
            with _lock:
                if fault.text in _fired and not fault.always:
                    continue
                _fired.add(fault.text)
            raise FaultInjected(
                f"injected fault ({ENV_VAR}={fault.text}): task {task!r} fails {point} its work"
            )


def maybe_kill(point: str, n: int) -> None:
    """SIGKILL this process if ``PPOFLOW_FAULT`` has ``kill:<point>:<n>`` (module docstring)."""
    for fault in _current():
        if fault.kind == KILL and fault.target == point and fault.where == str(n):
            import signal
            import sys

            print(f"[ppoflow] injected fault: killed at {point} {n}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def stalls(point: str, n: int) -> bool:
    """True (once per process, unless ``:always``) if ``PPOFLOW_FAULT`` has ``stall:<point>:<n>``."""
    for fault in _current():
        if fault.kind == STALL and fault.target == point and fault.where == str(n):
            with _lock:
                if fault.text in _fired and not fault.always:
                    continue
                _fired.add(fault.text)
            return True
    return False


def without_kills(spec: str | None) -> str:
    """A ``PPOFLOW_FAULT`` value without its ``kill`` entries (for a process started again)."""
    return ",".join(f.text for f in parse(spec) if f.kind != KILL)


def rank_fault_env() -> dict[str, str]:
    """The ``env`` to give a new worker group: the rank entries not yet spent in this process.

    Always sets ``PPOFLOW_FAULT`` (possibly empty), so task entries never reach the ranks."""
    with _lock:
        live = [
            f.rank_spec for f in _current() if f.kind in RANK_KINDS and (f.always or f.text not in _fired)
        ]
    return {ENV_VAR: ",".join(live)}


def note_rank_failure(method: str | None) -> None:
    """Mark the rank entries for ``method`` as spent (called when a call of it failed)."""
    with _lock:
        for f in _current():
            if f.kind in RANK_KINDS and f.target == method:
                _fired.add(f.text)


def rank_entries() -> set[tuple[str, str, int]]:
    """Rank side: the ``(kind, method, rank)`` of the rank entries in this process's
    ``PPOFLOW_FAULT`` (a group's ranks get only the entries not yet spent, see
    :func:`rank_fault_env`); method starts are fired by the rank entry."""
    return {(f.kind, f.target, int(f.where)) for f in _current() if f.kind in RANK_KINDS}


def rank_point(point: str) -> None:
    """Rank side: fire a ``rank_exit`` / ``rank_raise`` entry aimed at ``point`` on this rank
    (``RANK`` from torch's launcher). Method starts are fired by the rank entry itself; this is for
    points inside a method, such as ``checkpoint_write``. Once per process unless ``:always``."""
    rank = os.environ.get("RANK", "0")
    for fault in _current():
        if fault.kind not in RANK_KINDS or fault.kind == "rank_skip":
            continue
        if fault.target != point or fault.where != rank:
            continue
        with _lock:
            if fault.text in _fired and not fault.always:
                continue
            _fired.add(fault.text)
        if fault.kind == "rank_exit":
            import sys

            print(f"[ppoflow] injected fault: rank {rank} exits at {point}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(17)
        raise FaultInjected(f"injected fault ({ENV_VAR}={fault.text}) at {point} on rank {rank}")


def rank_skips(point: str) -> bool:
    """Rank side: True when a ``rank_skip`` entry aims at ``point`` on this rank (``RANK``) and has
    not fired yet in this process (or says ``:always``): the caller then skips that step."""
    rank = os.environ.get("RANK", "0")
    for fault in _current():
        if fault.kind != "rank_skip" or fault.target != point or fault.where != rank:
            continue
        with _lock:
            if fault.text in _fired and not fault.always:
                continue
            _fired.add(fault.text)
        import sys

        print(f"[ppoflow] injected fault: rank {rank} skips {point}", file=sys.stderr, flush=True)
        return True
    return False


def reset() -> None:
    """Forget which entries fired (each entry fires once more). For tests."""
    with _lock:
        _fired.clear()
