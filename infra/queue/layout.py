"""Where the rollout queue lives: ``<experiment>/queue/``, every URL joined inside it.

queue/
    policy/v000012/              the policy after update 12 (weights only, a DCP checkpoint)
    policy/latest.json           {version, ref}: the newest complete version (replace-if-match)
    batches/000013/claim.json    a producer's lease on batch 13 (create-if-absent, heartbeats)
    batches/000013/part-0000.arrow   finished sequences, published as they finish
    batches/000013/batch.arrow   the whole batch, rows in the data order of the synchronous rollout
    batches/000013/done.json     its record (hash, versions, staleness), published last
    stop.json                    the trainer's word that producers should stop
"""

from __future__ import annotations

import re

from ppoflow.infra.data import storage

__all__ = ["QueuePaths", "QUEUE_DIR"]

QUEUE_DIR = "queue"
_VERSION = re.compile(r"^v(\d{6,})$")
_BATCH = re.compile(r"^(\d{6,})$")
_PART = re.compile(r"^part-(\d{4,})\.arrow$")


class QueuePaths:
    """URLs of the rollout queue of the experiment at ``experiment_url``."""

    def __init__(self, experiment_url: str):
        self.experiment = experiment_url.rstrip("/")
        self.root = storage.join_inside(self.experiment, QUEUE_DIR)

    def ref(self, url: str) -> str:
        """``url`` relative to the experiment (as records store it)."""
        prefix = self.experiment + "/"
        return url[len(prefix) :] if url.startswith(prefix) else url

    def url(self, ref: str) -> str:
        """The URL of a reference :meth:`ref` made (joined inside the experiment)."""
        if "://" in ref or ref.startswith("/"):
            return ref
        return storage.join_inside(self.experiment, *ref.split("/"))

    # -- policy versions
    @property
    def policy_dir(self) -> str:
        return storage.join_inside(self.root, "policy")

    def policy(self, version: int) -> str:
        return storage.join_inside(self.root, "policy", f"v{version:06d}")

    @property
    def latest(self) -> str:
        return storage.join_inside(self.root, "policy", "latest.json")

    def versions(self) -> list[int]:
        """The version directories on storage (complete or not), ascending."""
        return sorted(int(m.group(1)) for name in _ls(self.policy_dir) if (m := _VERSION.match(name)))

    # -- batches
    @property
    def batches_dir(self) -> str:
        return storage.join_inside(self.root, "batches")

    def batch_dir(self, k: int) -> str:
        return storage.join_inside(self.root, "batches", f"{k:06d}")

    def claim(self, k: int) -> str:
        return storage.join_inside(self.batch_dir(k), "claim.json")

    def part(self, k: int, j: int) -> str:
        return storage.join_inside(self.batch_dir(k), f"part-{j:04d}.arrow")

    def batch(self, k: int) -> str:
        return storage.join_inside(self.batch_dir(k), "batch.arrow")

    def done(self, k: int) -> str:
        return storage.join_inside(self.batch_dir(k), "done.json")

    def batch_numbers(self) -> list[int]:
        """The batches with a directory on storage, ascending."""
        return sorted(int(m.group(1)) for name in _ls(self.batches_dir) if (m := _BATCH.match(name)))

    def parts(self, k: int) -> list[str]:
        """The URLs of batch ``k``'s published parts, in order."""
        found = sorted(int(m.group(1)) for name in _ls(self.batch_dir(k)) if (m := _PART.match(name)))
        return [self.part(k, j) for j in found]

    @property
    def stop(self) -> str:
        return storage.join_inside(self.root, "stop.json")


def _ls(url: str) -> list[str]:
    """The entry names in ``url`` (none when it does not exist)."""
    try:
        return [name.rstrip("/").rsplit("/", 1)[-1] for name in storage.listdir(url)]
    except FileNotFoundError:
        return []
