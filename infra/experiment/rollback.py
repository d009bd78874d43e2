"""Moving an experiment back to an earlier committed iteration (``ppoflow rollback EXP --to N``).

    manifest = rollback(ExperimentPaths(url), 5)

1. Under the experiment lock (no run may be active), read ``iterations/N/manifest.json``.
2. Verify every checkpoint it names (every file's size and content hash): a missing, incomplete,
   damaged or weights-only checkpoint refuses the rollback, naming it and the iterations that
   could be used instead.
3. Remove the task receipts of the iterations after N, so a rerun computes them again instead of
   reusing work from the abandoned timeline (their data and checkpoints stay on storage; rerun
   iterations replace them, retention removes what no kept manifest needs).
4. Publish the manifest of N as the root manifest (one atomic write): the commit point.

The next run continues after N. Unchanged config and data, it commits bit for bit what the
abandoned run committed at N+1 (resume is deterministic).
"""

from __future__ import annotations

import uuid

from ppoflow.infra.checkpoint.marker import ROLLBACK_HINT, CheckpointError, verify_checkpoint
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest, read_manifest
from ppoflow.infra.experiment.retention import checkpoint_sizes

__all__ = ["rollback", "RollbackRefused", "restorable_iterations"]


class RollbackRefused(CheckpointError):
    """The target iteration cannot be restored (nothing was changed)."""


def restorable_iterations(paths: ExperimentPaths, up_to: int) -> list[int]:
    """Iterations <= ``up_to`` whose manifest copy exists and whose actor checkpoint is on storage
    with optimizer state (a quick check from the markers; :func:`rollback` verifies in full)."""
    resumable = {
        row["iteration"]
        for row in checkpoint_sizes(paths, up_to)
        if row["role"] == "actor" and row["resumable"]
    }
    return [k for k in sorted(resumable) if storage.exists(paths.file(k, "manifest.json"))]


def _refuse(paths: ExperimentPaths, to: int, current: int, why: str) -> RollbackRefused:
    options = [k for k in restorable_iterations(paths, current) if k != to]
    listed = ", ".join(map(str, options)) or "none"
    return RollbackRefused(
        f"cannot roll {paths.root} back to iteration {to}: {why}. Iterations whose checkpoints are "
        f"kept with optimizer state: {listed}; nothing was changed"
    )


def rollback(paths: ExperimentPaths, to: int, verify: bool = True) -> Manifest:
    """Make committed iteration ``to`` the experiment's latest (see the module docstring);
    returns its manifest. Raises :class:`RollbackRefused` (nothing changed) or
    ``ExperimentLocked`` (a run is active)."""
    with ExperimentLock(paths.lock, run_id=f"rollback-{uuid.uuid4().hex[:8]}"):
        current = read_manifest(paths)
        if current is None:
            raise RollbackRefused(f"{paths.root} holds no experiment (no manifest.json)")
        if to > current.iteration:
            raise _refuse(
                paths, to, current.iteration, f"the last committed iteration is {current.iteration}"
            )
        url = paths.file(to, "manifest.json")
        if not storage.exists(url):
            raise _refuse(paths, to, current.iteration, f"its manifest copy {url} is missing")
        target = Manifest.from_json(storage.read_json(url), url)
        if target.iteration != to:
            raise _refuse(
                paths, to, current.iteration, f"{url} is the manifest of iteration {target.iteration}"
            )
        own = [r for r in (target.actor_checkpoint, target.critic_checkpoint) if r]
        for ref in [*own, *(r for r in target.checkpoints() if r not in own)]:
            checkpoint = paths.url(ref)
            try:
                marker = verify_checkpoint(checkpoint, deep=verify)
            except (CheckpointError, FileNotFoundError) as exc:
                reason = str(exc).replace(ROLLBACK_HINT, "").rstrip("; \n")
                raise _refuse(
                    paths, to, current.iteration, f"its checkpoint {ref} is not usable ({reason})"
                ) from None
            if marker.get("optimizer") is None:
                raise _refuse(
                    paths,
                    to,
                    current.iteration,
                    f"its checkpoint {ref} keeps the model weights only (checkpoint.keep_every_weights_only), "
                    "so training cannot continue from it exactly",
                )
        _forget_later_receipts(paths, to)
        storage.write_json_atomic(paths.manifest, target.to_json())
    return target


def _forget_later_receipts(paths: ExperimentPaths, to: int) -> None:
    base = storage.join(paths.root, "iterations")
    for name in storage.listdir(base) if storage.exists(base) else []:
        if name.isdigit() and int(name) > to:
            tasks = storage.join(base, name, "tasks")
            if storage.exists(tasks):
                storage.rm(tasks, recursive=True)
