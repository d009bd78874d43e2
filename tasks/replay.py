"""Rebuilding a state that was not written: the latest snapshot, then the stored updates after it.

An update of iteration n is a deterministic function of the state it starts from (weights,
optimizer and LR schedule, RNG) and of its batch, ``iterations/n/advantages.arrow``, which is on
storage before the update runs. So only every ``checkpoint.snapshot_every``-th state is written (a
*snapshot*); the update task of any other iteration records how its state came about (its
receipt's ``replay``: the state it started from, the batch, the worker method), and the manifest
of a committed iteration keeps the chain of such updates since each role's snapshot, with every
batch's size and XXH3 hash (:func:`replay_entry`).

A state the run needs that is not on storage is rebuilt (``RunGroups._load``): follow the records
back to a state that is (:func:`replay_chain`), load it, run the updates again in order. The result
equals the state that was lost bit for bit where the updates are deterministic (CPU, gloo; on
GPUs, with deterministic kernels) and with the same number of ranks. Every update hands each rank
its share of each mini-batch (:func:`update_blocks`), so on another number of ranks the replay
makes the same optimizer steps, equal up to the order of float sums.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ppoflow.infra.checkpoint.marker import CheckpointError, is_complete
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.data.hashing import hash_file
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest
from ppoflow.tasks.receipts import Receipt

__all__ = [
    "ReplayStep",
    "ReplayError",
    "replay_chain",
    "replay_entry",
    "committed_chain",
    "verify_batch",
    "state_iteration",
    "update_blocks",
]


class ReplayError(CheckpointError):
    """A state cannot be rebuilt: a batch it replays is missing or damaged, or no stored state
    starts its chain. The message names the file, the iterations it makes unrecoverable and the
    way out (a rollback to the snapshot)."""


@dataclass(frozen=True)
class ReplayStep:
    """One update to run again: ``method`` on ``batch`` turns state ``previous`` into ``state``."""

    role: str
    state: str
    previous: str
    method: str
    batch: str
    iteration: int


def update_blocks(cfg: ExperimentConfig, method: str) -> int:
    """Rows of one mini-batch of update ``method`` over all ranks (``ppo_mini_batch_size *
    rollout.n``): the blocks its batch is split by (``WorkerGroup.call``'s ``dp_blocks``)."""
    section = cfg.critic if method == "update_critic" else cfg.actor
    return section.ppo_mini_batch_size * cfg.rollout.n


def state_iteration(url: str) -> int:
    """The iteration a state URL (``.../checkpoints/<role>/000012``) belongs to."""
    return int(os.path.basename(url.rstrip("/")))


def _recorded(paths: ExperimentPaths, role: str, url: str) -> ReplayStep | None:
    """How the update task of ``url``'s iteration made it, from its receipt (None: no record)."""
    n = state_iteration(url)
    receipt_url = paths.receipt(n, f"update_{role}")
    if not storage.exists(receipt_url):
        return None
    receipt = Receipt.model_validate(storage.read_json(receipt_url))
    entry = receipt.replay.get(role)
    if entry is None or paths.ref(url) != receipt.checkpoints.get(role):
        return None
    return ReplayStep(
        role, url, paths.url(entry["previous"]) or "", entry["method"], paths.url(entry["batch"]) or "", n
    )


def _snapshot_hint(paths: ExperimentPaths, role: str, base: int, last: int) -> str:
    return (
        f"iterations {base + 1}-{last} of the {role} cannot be rebuilt; the way out: "
        f"`ppoflow rollback {paths.root} --to {base}` (the snapshot they replay from), then run again"
    )


def replay_chain(paths: ExperimentPaths, role: str, url: str) -> tuple[str, list[ReplayStep]]:
    """The stored state ``url`` is rebuilt from and the updates from it to ``url``, oldest first;
    :class:`ReplayError` when a record or a batch is missing."""
    steps: list[ReplayStep] = []
    current = url
    while not is_complete(current):
        step = _recorded(paths, role, current)
        if step is None:
            last = state_iteration(url)
            what = "" if not steps else f" (needed to rebuild iteration {last})"
            raise ReplayError(
                f"the {role} state of iteration {state_iteration(current)} ({current}) is neither a complete "
                f"checkpoint nor recorded as an update to replay{what}"
            )
        steps.insert(0, step)
        current = step.previous
    for step in steps:
        if not storage.exists(step.batch):
            raise ReplayError(
                f"the batch {step.batch} of iteration {step.iteration} is missing, and the {role} state of "
                f"iteration {state_iteration(url)} is rebuilt from it; "
                + _snapshot_hint(paths, role, state_iteration(current), state_iteration(url))
            )
    return current, steps


def replay_entry(paths: ExperimentPaths, receipt: Receipt, role: str) -> dict[str, Any]:
    """What a manifest keeps of an update that was not written: the states before and after it,
    and its batch with the batch's size and XXH3 hash (read once, at commit)."""
    entry = receipt.replay[role]
    fs, path = storage.url_to_fs(entry["batch"])
    size, digest = hash_file(fs, path)
    record = {
        "iteration": receipt.iteration,
        "state": paths.ref(receipt.checkpoints[role]),
        "previous": paths.ref(entry["previous"]),
        "batch": paths.ref(entry["batch"]),
        "bytes": size,
        "xxh3": digest,
    }
    if entry.get("snapshot") == "deferred":  # its state is being written too (tasks/update.py)
        record["snapshot"] = True
    return record


def committed_chain(paths: ExperimentPaths, role: str, state: str) -> list[dict[str, Any]]:
    """The replay records of ``role``'s chain up to ``state`` as the commit of ``state``'s
    iteration recorded them (empty when that iteration is not committed)."""
    url = paths.file(state_iteration(state), "manifest.json")
    if not storage.exists(url):
        return []
    return Manifest.from_json(storage.read_json(url), url).replay.get(role, [])


def verify_batch(paths: ExperimentPaths, step: ReplayStep, records: list[dict[str, Any]]) -> None:
    """Check ``step``'s batch against the size and hash its commit recorded (``records``: the
    chain of the committed state being rebuilt; an uncommitted iteration's batch was written by
    this run or the one before it: nothing to check against)."""
    record = next((r for r in records if r["iteration"] == step.iteration), None)
    if record is None:
        return
    fs, path = storage.url_to_fs(step.batch)
    size, digest = hash_file(fs, path)
    if (size, digest) != (record["bytes"], record["xxh3"]):
        base = state_iteration(paths.url(records[0]["previous"]) or "0")
        raise ReplayError(
            f"the batch {step.batch} of iteration {step.iteration} is damaged ({size} bytes, hash {digest}; its "
            f"commit recorded {record['bytes']} bytes, hash {record['xxh3']}); "
            + _snapshot_hint(paths, step.role, base, state_iteration(paths.url(records[-1]["state"]) or "0"))
        )
