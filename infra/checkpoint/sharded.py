"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) on any fsspec URL.

    save_checkpoint(url, model, optimizer, lr_scheduler, extra={"iteration": 12})   # every rank
    extra = load_checkpoint(url, model, optimizer, lr_scheduler)                    # every rank
    weights = load_full_state_dict(url)            # one process, no collectives: {hf_name: tensor}
    verify_checkpoint(url)                         # one process: every file's size and content hash

A checkpoint saved by N ranks loads on M ranks, into any FSDP2 layout (1-D, 2-D HSDP mesh) or a
plain module: DCP reshards. Plain paths and ``file://`` use DCP's local writer; other URLs
(``s3://``, ``memory://``) ``FsspecWriter``/``FsspecReader`` with ``ppoflow.infra.data.storage``'s
options. Writing (also in the background, staged in host memory) is
:class:`~ppoflow.infra.checkpoint.writer.CheckpointWriter`; the layout is described there, the
marker and its checks in :mod:`~ppoflow.infra.checkpoint.marker`.

Only tensors go through DCP: loading never unpickles our data (DCP's ``.metadata`` is DCP's own).
Model tensors are stored under Hugging Face names (see :func:`hf_key_prefix` for wrappers). An
optimizer that never stepped is saved without tensors and loads as such.

Verification: every load first checks the files it will read against the sizes and XXH3-64 hashes
in the marker (``verify=True``); on ranks the files are split between them, so the group reads the
checkpoint once more in parallel. A mismatch raises :class:`CorruptCheckpointError` naming each bad
file. A checkpoint already verified by this process (same marker) is not hashed again.

RNG: each rank saves its own states. On load with the same world size rank r gets rank r's states
back; with another world size RNG is left untouched (ranks keep their current, seeded streams)
and a warning is logged: there is no meaningful map from N streams to M.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp

from ppoflow.infra.checkpoint._dist import all_gather_json, rank_world
from ppoflow.infra.checkpoint.marker import (
    MARKER,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    corrupt_error,
    is_complete,
    options,
    read_marker,
    verify_checkpoint,
    verify_files,
)
from ppoflow.infra.checkpoint.state import (
    MODEL,
    OPTIM,
    RNG,
    Collected,
    collect,
    dec,
    hf_key_prefix,
    restore,
    rng_file,
    set_rng_state,
)
from ppoflow.infra.checkpoint.writer import CheckpointWriter, dcp_call, make_reader
from ppoflow.infra.data import storage

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "model_tensor_bytes",
    "verify_checkpoint",
    "is_complete",
    "read_marker",
    "hf_key_prefix",
    "CheckpointError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "MARKER",
]

_LOG = logging.getLogger("ppoflow.checkpoint")
_verified: set[tuple[str, str, str]] = set()  # (url, marker hash, file) checked by this process
_verified_lock = threading.Lock()


def save_checkpoint(
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    storage_options: dict | None = None,
) -> str:
    """Save model (+ optimizer, LR scheduler, ``extra``, RNG) to ``url``; collective on every rank.

    Args:
        url: a directory path or fsspec URL; an existing checkpoint there is replaced (its marker
            is removed first, so a crash midway leaves an incomplete, refused directory).
        model: a plain module or an FSDP2 module (1-D or HSDP mesh).
        optimizer: optional; its state is saved sharded like the parameters. Without it the
            checkpoint is weights-only.
        lr_scheduler: optional; anything with a JSON-able ``state_dict()`` (e.g. ``LambdaLR``).
        extra: optional JSON dict (step, iteration, ...) returned by ``load_checkpoint``.
        storage_options: fsspec options on top of ``ppoflow.infra.data.storage``'s defaults.

    Returns:
        ``url``, once the checkpoint is published (every rank returns after the marker exists).
    """
    CheckpointWriter().save(url, model, optimizer, lr_scheduler, extra, storage_options)
    return url


def _layout(marker: dict[str, Any]) -> dict[str, str | None]:
    """Where the model and optimizer DCP directories are (format v1: both at the root)."""
    return marker.get("layout") or {MODEL: "", OPTIM: ""}


def _verify(url: str, marker: dict[str, Any], opts: dict, parts: tuple[str, ...], distributed: bool) -> None:
    """Check the files of ``parts`` (subdirectory names) against the marker; on ranks, each rank
    checks its share and every rank raises the same error naming every bad file. Files this
    process saw verified (same marker) are skipped."""
    files = marker.get("files")
    if files is None:
        _LOG.warning("checkpoint %s has format %s: no file hashes to verify", url, marker.get("format"))
        return
    stamp = str(marker.get("marker_xxh3_64"))
    with _verified_lock:
        chosen = sorted(
            name for name in files if name.split("/", 1)[0] in parts and (url, stamp, name) not in _verified
        )
    rank, world = rank_world() if distributed else (0, 1)
    problems = verify_files(url, {name: files[name] for name in chosen[rank::world]}, opts)
    if distributed:
        problems = [p for rank_problems in all_gather_json(problems) for p in rank_problems]
    if problems:
        raise corrupt_error(url, problems)
    with _verified_lock:
        _verified.update((url, stamp, name) for name in chosen)


def load_checkpoint(
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    storage_options: dict | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a published checkpoint into ``model`` (+ ``optimizer``, ``lr_scheduler``); collective.

    The model and optimizer may be laid out differently from the saving run (other world size,
    1-D FSDP, HSDP, or no FSDP at all). With ``restore_rng`` and the same world size each rank
    gets its own RNG states back; otherwise RNG is left as it is (see the module docstring).
    ``verify``: check the files read against the marker first (see the module docstring).

    Returns the ``extra`` dict given to ``save_checkpoint``. Raises IncompleteCheckpointError (no
    publish marker), CorruptCheckpointError (a file differs from the marker), FileNotFoundError
    (nothing at ``url``) or CheckpointError (the checkpoint does not match the model/optimizer, or
    a read failed).
    """
    t0, (rank, world), opts = time.perf_counter(), rank_world(), options(url, storage_options)
    marker = read_marker(url, opts)
    _check_saved_parts(url, marker, optimizer, lr_scheduler)
    with_optim = optimizer is not None and not marker["optimizer"].get("fresh")
    if verify:
        parts = (MODEL, RNG) + ((OPTIM,) if with_optim else ())
        _verify(url, marker, opts, parts, distributed=True)
    got = collect(model, optimizer, for_save=False)
    _load_tensors(url, marker, opts, got, with_optim)
    restore(model, optimizer, got, marker["optimizer"], url)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(dec(marker["lr_scheduler"]))
    if restore_rng:
        _restore_rng(url, marker, opts, rank, world)
    _LOG.info(
        "loaded checkpoint %s (saved by %d ranks) on %d ranks in %.2fs",
        url,
        marker["world_size"],
        world,
        time.perf_counter() - t0,
    )
    return dec(marker["extra"])


def _check_saved_parts(url: str, marker: dict[str, Any], optimizer: Any, lr_scheduler: Any) -> None:
    """CheckpointError when the caller asks for an optimizer or LR scheduler state the checkpoint
    does not hold."""
    if optimizer is not None and marker["optimizer"] is None:
        raise CheckpointError(
            f"checkpoint {url} has no optimizer state (a weights-only checkpoint); load "
            "it with optimizer=None and start the optimizer fresh"
        )
    if lr_scheduler is not None and marker["lr_scheduler"] is None:
        raise CheckpointError(f"checkpoint {url} has no LR scheduler state; pass lr_scheduler=None")


def _load_tensors(url: str, marker: dict[str, Any], opts: dict, got: Collected, with_optim: bool) -> None:
    """Read the model's (and with ``with_optim`` the optimizer's) tensors into ``got``'s state dicts:
    DCP loads in place, resharding to their layout."""
    layout = _layout(marker)
    dcp_call(
        "loading",
        url,
        dcp.load,
        got.model,
        storage_reader=make_reader(storage.join(url, cast(str, layout[MODEL])), opts),  # always saved
    )
    if with_optim:
        reader = make_reader(storage.join(url, cast(str, layout[OPTIM])), opts)  # saved with the state
        dcp_call("loading", url, dcp.load, got.optim, storage_reader=reader)


def _restore_rng(url: str, marker: dict[str, Any], opts: dict, rank: int, world: int) -> None:
    """Give this rank its saved RNG states back when the world size is the one saved; otherwise
    leave them (rank 0 logs why)."""
    if marker["world_size"] == world:
        set_rng_state(storage.read_json(storage.join(url, rng_file(rank)), opts))
    elif rank == 0:
        _LOG.warning(
            "checkpoint %s was saved by %d ranks and is loaded on %d: RNG states are not "
            "restored (each rank keeps its current RNG stream)",
            url,
            marker["world_size"],
            world,
        )


def _model_metadata(url: str, opts: dict) -> tuple[Any, dict[str, Any]]:
    """The reader of the checkpoint's model files and ``{hf_name: tensor metadata}``."""
    marker = read_marker(url, opts)
    reader = make_reader(storage.join(url, cast(str, _layout(marker)[MODEL])), opts)  # always saved
    lead = MODEL + "."
    items = reader.read_metadata().state_dict_metadata.items()
    return reader, {k[len(lead) :]: v for k, v in items if k.startswith(lead)}


def model_tensor_bytes(url: str, storage_options: dict | None = None) -> dict[str, int]:
    """``{hf_name: bytes}`` of every full model tensor in the checkpoint (from its metadata alone)."""
    _, available = _model_metadata(url, options(url, storage_options))
    return {k: v.size.numel() * v.properties.dtype.itemsize for k, v in available.items()}


def load_full_state_dict(
    url: str,
    keys: list[str] | set[str] | None = None,
    storage_options: dict | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """Read full (unsharded) model tensors by HF name, in this process only (no collectives, so it
    works with or without a process group and on any subset of ranks).

    ``keys``: HF names to read (``"model.layers.0.mlp.up_proj.weight"``); None = every model tensor
    (tied models hold both ``model.embed_tokens.weight`` and ``lm_head.weight``). ``verify``: check
    the model files against the marker first (once per process and checkpoint). Returns
    ``{hf_name: tensor}`` on the CPU, in the dtype they were written in (the model's, or the
    ``dtype`` of a weights-only save).
    """
    opts = options(url, storage_options)
    if verify:
        _verify(url, read_marker(url, opts), opts, (MODEL,), distributed=False)
    reader, available = _model_metadata(url, opts)
    wanted = set(available) if keys is None else set(keys)
    missing = sorted(wanted - set(available))
    if missing:
        raise KeyError(
            f"checkpoint {url} has no model tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            f"it has {len(available)} (e.g. {sorted(available)[:3]}); names are Hugging Face names"
        )
    out = {k: torch.empty(available[k].size, dtype=available[k].properties.dtype) for k in sorted(wanted)}
    dcp_call("reading", url, dcp.load, {MODEL: out}, storage_reader=reader, no_dist=True)
    return out
