"""Moving an experiment back to an earlier committed iteration (``ppoflow rollback EXP --to N``).

    manifest = rollback(ExperimentPaths(url), 5)

1. Under the experiment lock (no run may be active), read ``iterations/N/manifest.json``.
2. Verify every checkpoint it needs (every file's size and content hash) and, for a state that
   is rebuilt from a snapshot, every batch its updates replay (size and hash as committed): a
   missing, incomplete, damaged or weights-only checkpoint, or a missing or changed batch, refuses
   the rollback, naming it and the iterations that could be used instead.
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
from ppoflow.infra.data.hashing import hash_file
from ppoflow.infra.experiment.lock import ExperimentLock
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest, read_manifest
from ppoflow.infra.experiment.retention import checkpoint_sizes

__all__ = ["rollback", "RollbackRefused", "restorable_iterations"]


class RollbackRefused(CheckpointError):
    """The target iteration cannot be restored (nothing was changed)."""


def restorable_iterations(paths: ExperimentPaths, up_to: int) -> list[int]:
    """Iterations <= ``up_to`` whose manifest copy exists and whose actor state is on storage with
    optimizer state, or is rebuilt from a snapshot that is (a quick check from the markers and the
    manifests; :func:`rollback` verifies in full)."""
    resumable = {
        paths.ref(paths.checkpoint("actor", row["iteration"]))
        for row in checkpoint_sizes(paths, up_to)
        if row["role"] == "actor" and row["resumable"]
    }
    out = []
    for k in range(up_to + 1):
        url = paths.file(k, "manifest.json")
        if (
            storage.exists(url)
            and Manifest.from_json(storage.read_json(url), url).snapshot("actor") in resumable
        ):
            out.append(k)
    return out


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
        _verify_replay(paths, target, current.iteration)
        own = [r for r in (target.snapshot("actor"), target.snapshot("critic")) if r]
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


def _verify_replay(paths: ExperimentPaths, target: Manifest, current: int) -> None:
    """The batches ``target``'s states are replayed from must be as their commits recorded them."""
    for role, chain in target.replay.items():
        for entry in chain:
            url = paths.url(entry["batch"])
            if not storage.exists(url):
                raise _refuse(
                    paths,
                    target.iteration,
                    current,
                    f"the {role}'s state is rebuilt from {url}, which is missing",
                )
            fs, path = storage.url_to_fs(url)
            if hash_file(fs, path) != (entry["bytes"], entry["xxh3"]):
                raise _refuse(
                    paths,
                    target.iteration,
                    current,
                    f"the {role}'s state is rebuilt from {url}, which is damaged",
                )


def _forget_later_receipts(paths: ExperimentPaths, to: int) -> None:
    base = storage.join(paths.root, "iterations")
    for name in storage.listdir(base) if storage.exists(base) else []:
        if name.isdigit() and int(name) > to:
            tasks = storage.join(base, name, "tasks")
            if storage.exists(tasks):
                storage.rm(tasks, recursive=True)
