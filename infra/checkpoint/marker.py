"""The publish marker of a checkpoint (``ppoflow_complete.json``), its errors, and verification.

    is_complete(url)                 # the marker exists: every file of the checkpoint was written
    marker = read_marker(url)        # parsed and self-checked; raises if missing, unknown or damaged
    verify_checkpoint(url)           # every file the marker lists: present, same size, same xxh3 hash

The marker is written last, atomically, by rank 0. It records everything non-tensor (optimizer
param groups, LR scheduler, ``extra``, world size) and, since format v2, every file of the
checkpoint with its size and XXH3-64 content hash, plus a hash of its own content. A checkpoint is
*complete* when its marker exists, and *intact* when :func:`verify_checkpoint` passes. Loads verify
before they read tensors (:mod:`ppoflow.infra.checkpoint.sharded`).

A background write that fails leaves ``ppoflow_failed.json`` (the ranks' errors) instead of a
marker; :func:`read_failure` returns it.

Format v1 markers (written before the marker listed the files: model and optimizer in one DCP
directory, no file list) are still read and loaded; they cannot be verified
(:func:`verify_checkpoint` says so in its result).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.data.hashing import ALGORITHM, hash_bytes, hash_file

__all__ = [
    "MARKER",
    "FAILED",
    "FORMAT",
    "READABLE_FORMATS",
    "ROLLBACK_HINT",
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointWriteFailed",
    "options",
    "is_complete",
    "read_marker",
    "write_marker",
    "read_failure",
    "write_failure",
    "verify_checkpoint",
    "verify_files",
    "checkpoint_bytes",
]

_LOG = logging.getLogger("ppoflow.checkpoint")

MARKER = "ppoflow_complete.json"
FAILED = "ppoflow_failed.json"
FORMAT = "ppoflow-dcp-v2"
READABLE_FORMATS = ("ppoflow-dcp-v1", FORMAT)
_SELF = "marker_xxh3_64"

#: Appended to errors about a damaged or missing checkpoint: how an experiment gets back to a good one.
ROLLBACK_HINT = (
    "if this checkpoint belongs to an experiment, move the experiment back to an earlier committed "
    "iteration whose checkpoints verify: `ppoflow rollback EXPERIMENT --to N` "
    "(`ppoflow status EXPERIMENT` lists the iterations whose checkpoints are kept)"
)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (wraps DCP's ``CheckpointException``, which
    derives from ``BaseException``), or it does not match the model/optimizer given."""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but has no publish marker: the save was interrupted or failed."""


class CorruptCheckpointError(CheckpointError):
    """A published checkpoint whose files differ from what its marker recorded (missing,
    truncated, or different content), or whose marker is damaged."""


class CheckpointWriteFailed(CheckpointError):
    """A (background) write failed on some rank after its retries; see ``ppoflow_failed.json``."""


def options(url: str, storage_options: dict | None) -> dict:
    """The fsspec options ``ppoflow.infra.data.storage`` would use for ``url`` (defaults + per-call)."""
    proto = storage.protocol_of(url)
    opts = {
        **(storage.get_default_storage_options("s3") if proto == "s3a" else {}),
        **storage.get_default_storage_options(proto),
    }
    return {**opts, **(storage_options or {})}


def _fs(url: str, opts: dict) -> tuple[Any, str]:
    fs, path = storage.url_to_fs(url, opts)
    fs.invalidate_cache(path)
    return fs, path


def is_complete(url: str, storage_options: dict | None = None) -> bool:
    """True when ``url`` holds a published checkpoint (the marker written after every shard)."""
    fs, path = _fs(url, options(url, storage_options))
    return fs.exists(storage.join(path, MARKER))


def _self_hash(marker: dict[str, Any]) -> str:
    body = {k: v for k, v in marker.items() if k != _SELF}
    return hash_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_marker(url: str, marker: dict[str, Any], storage_options: dict | None = None) -> None:
    """Publish ``marker`` at ``url`` (atomically), with a hash of its own content."""
    opts = options(url, storage_options)
    body = {k: v for k, v in marker.items() if k != _SELF}
    storage.write_json_atomic(storage.join(url, MARKER), {**body, _SELF: _self_hash(body)}, opts)


def read_marker(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The publish marker of a checkpoint (world size, extra, scheduler state, files, ...).

    Raises ``FileNotFoundError`` when nothing is at ``url``, :class:`IncompleteCheckpointError`
    when the directory exists without the marker, :class:`CorruptCheckpointError` when the marker
    is damaged, and :class:`CheckpointError` for a format this code does not read.
    """
    opts = options(url, storage_options)
    fs, path = _fs(url, opts)
    if not fs.exists(storage.join(path, MARKER)):
        if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
            failure = read_failure(url, opts)
            why = f"its write failed: {failure}" if failure else "it was interrupted before publish"
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {url}: {why} (no {MARKER}); use the previous iteration's "
                f"checkpoint; {ROLLBACK_HINT}"
            )
        raise FileNotFoundError(
            f"no checkpoint at {url}: nothing was saved there (check the URL and the "
            "storage options / AWS_* credentials)"
        )
    raw = storage.read_bytes(storage.join(url, MARKER), opts)
    try:
        marker = json.loads(raw)
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise CorruptCheckpointError(
            f"checkpoint {url}: its marker {MARKER} is damaged ({exc}); {ROLLBACK_HINT}"
        ) from None
    fmt = marker.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(
            f"{url}: unknown checkpoint format {fmt!r} (this code reads {', '.join(READABLE_FORMATS)})"
        )
    if fmt != "ppoflow-dcp-v1" and marker.get(_SELF) != _self_hash(marker):
        raise CorruptCheckpointError(
            f"checkpoint {url}: its marker {MARKER} does not match its own recorded hash "
            f"(the file was changed or damaged after it was written); {ROLLBACK_HINT}"
        )
    return marker


def write_failure(url: str, errors: list[str], storage_options: dict | None = None) -> None:
    """Record why a write of ``url`` failed (best effort: storage itself may be what failed)."""
    try:
        storage.write_json_atomic(
            storage.join(url, FAILED), {"errors": errors}, options(url, storage_options)
        )
    except Exception as exc:  # noqa: BLE001 - the caller reports the original errors anyway
        _LOG.warning("could not record the failed write of %s: %s", url, exc)


def read_failure(url: str, storage_options: dict | None = None) -> str | None:
    """The errors of a failed write of ``url`` (None when it did not fail, or is still running)."""
    opts = options(url, storage_options)
    target = storage.join(url, FAILED)
    if not storage.exists(target, opts):
        return None
    try:
        errors = storage.read_json(target, opts).get("errors") or []
    except (OSError, ValueError, AttributeError):
        return "(unreadable failure record)"
    return "; ".join(str(e) for e in errors) or "(no error recorded)"


def verify_files(url: str, files: dict[str, dict[str, Any]], opts: dict, deep: bool = True) -> list[str]:
    """Problems with ``files`` (``{relative path: {size, xxh3_64}}``) under ``url``: one line per
    missing, resized or changed file; empty when all match."""
    fs, root = _fs(url, opts)
    problems = []
    for name in sorted(files):
        want = files[name]
        path = storage.join(root, name)
        try:
            size = fs.size(path)
        except FileNotFoundError:
            size = None
        if size is None:
            problems.append(f"{name}: missing (the marker lists it with {want['size']} bytes)")
            continue
        if size != want["size"]:
            problems.append(
                f"{name}: {size} bytes, the marker recorded {want['size']} (truncated or replaced)"
            )
            continue
        if deep:
            _, digest = hash_file(fs, path)
            if digest != want[ALGORITHM]:
                problems.append(
                    f"{name}: content differs from the recorded hash ({ALGORITHM} {digest}, "
                    f"recorded {want[ALGORITHM]}): the file is corrupt"
                )
    return problems


def corrupt_error(url: str, problems: list[str]) -> CorruptCheckpointError:
    """The error for ``problems`` found in checkpoint ``url``."""
    listed = "\n  ".join(problems)
    return CorruptCheckpointError(
        f"checkpoint {url} is damaged; {len(problems)} file(s) do not match its marker:\n  {listed}\n"
        f"{ROLLBACK_HINT}"
    )


def verify_checkpoint(
    url: str, storage_options: dict | None = None, deep: bool = True, files: list[str] | None = None
) -> dict[str, Any]:
    """Check that the checkpoint at ``url`` is complete and intact; returns its marker.

    Every file the marker lists must exist with the recorded size and (``deep``) XXH3-64 hash;
    ``files`` restricts the check to those names. Reads each checked file once (cost: the bytes
    read, at storage speed or the hash speed, whichever is lower). A format-v1 checkpoint has no
    file list: it is returned with ``verified`` False. Raises :class:`IncompleteCheckpointError`,
    :class:`CorruptCheckpointError` (naming each bad file) or ``FileNotFoundError``.
    """
    opts = options(url, storage_options)
    marker = read_marker(url, opts)
    listed = marker.get("files")
    if listed is None:
        return {**marker, "verified": False}
    chosen = listed if files is None else {k: listed[k] for k in files if k in listed}
    problems = verify_files(url, chosen, opts, deep=deep)
    if problems:
        raise corrupt_error(url, problems)
    return {**marker, "verified": True}


def checkpoint_bytes(marker: dict[str, Any]) -> int | None:
    """Total size of the files a marker lists (None for format v1, which lists none)."""
    files = marker.get("files")
    return None if files is None else sum(int(f["size"]) for f in files.values())
