"""Which checkpoints an experiment keeps (``checkpoint.keep_last`` / ``keep_every``), removing the
rest, and the sizes ``ppoflow status`` shows.

After commit n the *kept iterations* are the last K committed ones (n-K+1 .. n) and every M-th
(k % M == 0, iteration 0 included). A checkpoint directory of iteration k <= n is removed when no
kept iteration's manifest (``iterations/k/manifest.json``; the root manifest for n) references it
(a manifest references its actor and critic checkpoints and, with one-step overlap, the ones the
next rollout uses; an every-M-th manifest kept weights-only only its own). Directories of iterations after n are never touched here: one may be being
written right now, or belong to the iterations a rollback left behind (they are replaced when
those iterations run again).

With ``keep_every_weights_only`` an every-M-th checkpoint that has left the last K keeps only its
model weights: its marker is rewritten first (so it never lists a file that is gone), then the
optimizer directory is removed. Such a checkpoint exports and loads as a policy, but an
experiment cannot be rolled back to it (``ppoflow rollback`` says so).
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any

from ppoflow.infra.checkpoint.marker import checkpoint_bytes, is_complete, read_marker, write_marker
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest

__all__ = ["kept_iterations", "referenced", "apply_retention", "strip_optimizer", "checkpoint_sizes", "ROLES"]

_LOG = logging.getLogger("ppoflow.retention")
ROLES = ("actor", "critic")


def kept_iterations(n: int, keep_last: int | None, keep_every: int) -> tuple[set[int], set[int]]:
    """(last-K iterations, every-M-th iterations) kept after committing ``n``."""
    last = set(range(0 if keep_last is None else max(0, n - keep_last + 1), n + 1))
    every = set(range(0, n + 1, keep_every)) if keep_every else set()
    return last, every


def _manifest_refs(paths: ExperimentPaths, k: int, current: Manifest) -> list[str]:
    """Checkpoints manifest ``k`` references; a missing copy references its own iteration's."""
    if k == current.iteration:
        return current.checkpoints()
    url = paths.file(k, "manifest.json")
    if storage.exists(url):
        return Manifest.from_json(storage.read_json(url), url).checkpoints()
    return [paths.ref(paths.checkpoint(role, k)) for role in ROLES]


def referenced(
    paths: ExperimentPaths, current: Manifest, kept: set[int], own_only: Set[int] = frozenset()
) -> set[str]:
    """Relative references of every checkpoint a kept manifest names; for iterations in
    ``own_only`` only their own iteration's checkpoints (weights-only kept: nothing resumes there)."""
    refs: set[str] = set()
    for k in sorted(kept):
        names = _manifest_refs(paths, k, current)
        if k in own_only:
            own = {paths.ref(paths.checkpoint(role, k)) for role in ROLES}
            names = [r for r in names if r in own]
        refs.update(names)
    return refs


def _checkpoint_dirs(paths: ExperimentPaths, up_to: int) -> dict[str, int]:
    """``{relative ref: iteration}`` of the checkpoint directories of iterations <= ``up_to``."""
    out = {}
    for role in ROLES:
        base = storage.join(paths.root, "checkpoints", role)
        if not storage.exists(base):
            continue
        for name in storage.listdir(base):
            if name.isdigit() and int(name) <= up_to:
                out[paths.ref(paths.checkpoint(role, int(name)))] = int(name)
    return out


def strip_optimizer(url: str) -> bool:
    """Make checkpoint ``url`` weights-only (marker first, then the optimizer files); True if it
    had optimizer files. Format-v1 checkpoints (one DCP directory) are left as they are."""
    marker = read_marker(url)
    layout = marker.get("layout")
    if not layout or not layout.get("optim"):
        return False
    sub = layout["optim"]
    files = {k: v for k, v in marker["files"].items() if not k.startswith(sub + "/")}
    slim = {
        **marker,
        "files": files,
        "layout": {**layout, "optim": None},
        "optimizer": None,
        "lr_scheduler": None,
        "weights_only": True,
    }
    slim["bytes"] = checkpoint_bytes(slim)
    write_marker(url, slim)
    storage.rm(storage.join(url, sub), recursive=True)
    return True


def apply_retention(paths: ExperimentPaths, policy: Any, current: Manifest) -> list[str]:
    """Remove the checkpoints of iterations <= ``current.iteration`` that no kept manifest
    references, and slim the every-M-th ones outside the last K (``policy``: a
    ``CheckpointConfig``). Returns the URLs removed."""
    n = current.iteration
    last, every = kept_iterations(n, policy.keep_last, policy.keep_every)
    slim = (every - last) if policy.keep_every_weights_only else set()
    refs = referenced(paths, current, last | every, own_only=slim)
    needed_whole = referenced(paths, current, last)
    removed = []
    for ref, k in sorted(_checkpoint_dirs(paths, n).items(), key=lambda item: item[1]):
        url = paths.url(ref)
        if ref not in refs:
            storage.rm(url, recursive=True)
            removed.append(url)
        elif policy.keep_every_weights_only and k in every and ref not in needed_whole:
            if is_complete(url) and strip_optimizer(url):
                _LOG.info("retention: %s keeps its weights only", url)
    return removed


def checkpoint_sizes(paths: ExperimentPaths, up_to: int) -> list[dict[str, Any]]:
    """Per iteration <= ``up_to`` still on storage: ``{iteration, role, bytes, resumable,
    complete}`` (``resumable``: it holds the optimizer's state, not only weights; bytes None for a
    format-v1 or incomplete checkpoint)."""
    rows = []
    for ref, k in sorted(_checkpoint_dirs(paths, up_to).items(), key=lambda item: (item[1], item[0])):
        url = paths.url(ref)
        role = ref.split("/")[1]
        row: dict[str, Any] = {
            "iteration": k,
            "role": role,
            "bytes": None,
            "resumable": None,
            "complete": False,
        }
        if is_complete(url):
            marker = read_marker(url)
            row.update(
                bytes=checkpoint_bytes(marker), resumable=marker.get("optimizer") is not None, complete=True
            )
        rows.append(row)
    return rows
