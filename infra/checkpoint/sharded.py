"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) on any fsspec URL.

    save_checkpoint(url, model, optimizer, lr_scheduler, extra={"iteration": 12})   # every rank
    extra = load_checkpoint(url, model, optimizer, lr_scheduler)                    # every rank
    weights = load_full_state_dict(url)            # one process, no collectives: {hf_name: tensor}

A checkpoint saved by N ranks loads on M ranks, into any FSDP2 layout (1-D, 2-D HSDP mesh) or a
plain module: DCP reshards. Plain paths and ``file://`` use DCP's local writer; other URLs
(``s3://``, ``memory://``) ``FsspecWriter``/``FsspecReader`` with ``ppoflow.infra.data.storage``'s options.

Layout of a checkpoint directory::

    .metadata, __<rank>_0.distcp   DCP, tensors only: "model.<hf name>", "optim.<hf name>.<exp_avg|...>"
    rng/rank_00000.json ...        each rank's RNG states (torch CPU, CUDA, python, numpy)
    ppoflow_complete.json          publish marker, written last by rank 0; holds everything non-tensor:
                                   optimizer param groups, LR scheduler state, ``extra``, world size

Only tensors go through DCP: loading never unpickles our data (DCP's ``.metadata`` is DCP's own).
Model tensors are stored under Hugging Face names (see :func:`hf_key_prefix` for wrappers). An
optimizer that never stepped is saved and loaded as such (DCP's state init is undone).

Publication: rank 0 removes an old marker, every rank writes, barrier, rank 0 writes the marker
atomically, barrier. Without the marker a directory was interrupted: loads refuse it with
:class:`IncompleteCheckpointError`.

RNG: each rank saves its own states. On load with the same world size rank r gets rank r's states
back; with another world size RNG is left untouched (ranks keep their current, seeded streams)
and a warning is logged: there is no meaningful map from N streams to M.
"""

from __future__ import annotations

import base64
import logging
import random
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ppoflow.infra.data import storage

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "load_full_state_dict",
    "is_complete",
    "read_marker",
    "hf_key_prefix",
    "CheckpointError",
    "IncompleteCheckpointError",
    "MARKER",
]

_LOG = logging.getLogger("ppoflow.checkpoint")

MARKER = "ppoflow_complete.json"
FORMAT = "ppoflow-dcp-v1"
_MODEL, _OPTIM = "model", "optim"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (wraps DCP's ``CheckpointException``, which
    derives from ``BaseException``), or it does not match the model/optimizer given."""


class IncompleteCheckpointError(CheckpointError):
    """The directory exists but has no publish marker: the save was interrupted."""


def _rank_world() -> tuple[int, int]:
    on = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if on else (0, 1)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _options(url: str, storage_options: dict | None) -> dict:
    """The fsspec options ``ppoflow.infra.data.storage`` would use for ``url`` (defaults + per-call)."""
    proto = url.split("://", 1)[0].lower() if "://" in url else "file"
    opts = {
        **(storage.get_default_storage_options("s3") if proto == "s3a" else {}),
        **storage.get_default_storage_options(proto),
    }
    return {**opts, **(storage_options or {})}


def _local_path(url: str) -> str | None:
    """The OS path of a local URL (plain path or ``file://``), else None."""
    return url if "://" not in url else url[len("file://") :] if url.startswith("file://") else None


def _writer(url: str, opts: dict):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    local = _local_path(url)
    if local is not None:
        return FileSystemWriter(local, single_file_per_rank=True, overwrite=True)
    # Never pass checkpoint_id= together with this writer: DCP would rebuild it without ``opts``.
    return FsspecWriter(url, single_file_per_rank=True, overwrite=True, **opts)


def _reader(url: str, opts: dict):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    local = _local_path(url)
    return FileSystemReader(local) if local is not None else FsspecReader(url, **opts)


def _enc(obj: Any, where: str) -> Any:
    """JSON-encode plain data, keeping tuples (``{"__tuple__": [...]}``); tensors are refused."""
    if isinstance(obj, tuple):
        return {"__tuple__": [_enc(v, where) for v in obj]}
    if isinstance(obj, list):
        return [_enc(v, where) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _enc(v, where) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise CheckpointError(
        f"{where}: a {type(obj).__name__} cannot be stored as JSON; checkpoints keep "
        "only tensors (in DCP) and plain JSON values (numbers, strings, lists, dicts)"
    )


def _dec(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"__tuple__"}:
        return tuple(_dec(v) for v in obj["__tuple__"])
    if isinstance(obj, (list, dict)):
        return [_dec(v) for v in obj] if isinstance(obj, list) else {k: _dec(v) for k, v in obj.items()}
    return obj


def hf_key_prefix(model: torch.nn.Module) -> str:
    """The prefix that separates the model's parameter names from Hugging Face names.

    ``""`` for a transformers ``PreTrainedModel`` (FSDP-wrapped or not). A wrapper may declare it
    with a string attribute ``hf_key_prefix`` (e.g. ``"hf."``). Otherwise, a module with exactly
    one ``PreTrainedModel`` child gets ``"<child name>."``. Names outside the prefix (a wrapper's
    own head) are stored as they are.
    """
    declared = getattr(model, "hf_key_prefix", None)
    if isinstance(declared, str):
        return declared
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return ""
    children = [name for name, child in model.named_children() if isinstance(child, PreTrainedModel)]
    return children[0] + "." if len(children) == 1 else ""


class _Names:
    """Map between the model's state-dict names and the stored (HF) names."""

    def __init__(self, model: torch.nn.Module, fqns: list[str]):
        self.prefix = hf_key_prefix(model)
        self.to_hf = {
            f: f[len(self.prefix) :] if self.prefix and f.startswith(self.prefix) else f for f in fqns
        }
        if len(set(self.to_hf.values())) != len(self.to_hf):
            raise CheckpointError(
                f"stripping the prefix {self.prefix!r} from the names of {type(model).__name__} "
                "makes two names equal; set a distinct `hf_key_prefix` attribute on the wrapper"
            )
        self.from_hf = {v: k for k, v in self.to_hf.items()}


def _split_optim(osd: dict, names: _Names) -> tuple[dict, dict]:
    """Optimizer state dict -> (tensors by HF name for DCP, JSON part: param groups + scalars)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        name = names.to_hf.get(fqn, fqn)
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(name, {})[key] = value
            else:
                scalars.setdefault(name, {})[key] = _enc(value, f"optimizer state {name}.{key}")
    groups = [
        {
            **{k: _enc(v, f"optimizer param_groups[{i}].{k}") for k, v in g.items() if k != "params"},
            "params": [names.to_hf.get(p, p) for p in g["params"]],
        }
        for i, g in enumerate(osd["param_groups"])
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def _collect(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model sd, optimizer sd or None, names, tensor tree for DCP, JSON part of the optimizer or None)."""
    msd, osd = (
        get_state_dict(model, optimizer) if optimizer is not None else (get_model_state_dict(model), None)
    )
    names = _Names(model, list(msd))
    state: dict[str, Any] = {_MODEL: {names.to_hf[k]: v for k, v in msd.items()}}
    optim_json = None
    if osd is not None:
        state[_OPTIM], optim_json = _split_optim(osd, names)
    return msd, osd, names, state, optim_json


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _rng_state() -> dict[str, Any]:
    """This rank's RNG states as JSON: torch CPU, current CUDA device (if used), python, numpy."""
    np_state = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "python": _enc(random.getstate(), "python RNG"),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    def unb64(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(unb64(state["torch_cpu"]))
    random.setstate(_dec(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(state["cuda"]))


def _rng_url(url: str, rank: int) -> str:
    return storage.join(url, "rng", f"rank_{rank:05d}.json")


def _dcp_call(what: str, url: str, fn, *args, **kwargs) -> None:
    """Run a DCP call, turning its ``CheckpointException`` (a BaseException) into CheckpointError."""
    try:
        with warnings.catch_warnings():  # DCP warns on every single-process call; that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
            warnings.filterwarnings(
                "ignore", message="Detected an existing checkpoint"
            )  # we replace on purpose
            fn(*args, **kwargs)
    except CheckpointException as exc:
        raise CheckpointError(f"{what} checkpoint {url} failed: {exc}") from exc


def is_complete(url: str, storage_options: dict | None = None) -> bool:
    """True when ``url`` holds a published checkpoint (the marker written after every shard)."""
    fs, path = storage.url_to_fs(url, _options(url, storage_options))
    fs.invalidate_cache(path)
    return fs.exists(storage.join(path, MARKER))


def read_marker(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """The publish marker of a checkpoint (world size, extra, scheduler state, ...).

    Raises ``FileNotFoundError`` when nothing is at ``url`` and :class:`IncompleteCheckpointError`
    when the directory exists without the marker.
    """
    opts = _options(url, storage_options)
    fs, path = storage.url_to_fs(url, opts)
    fs.invalidate_cache(path)
    if not fs.exists(storage.join(path, MARKER)):
        if fs.exists(path) and (not fs.isdir(path) or fs.ls(path)):
            raise IncompleteCheckpointError(
                f"incomplete checkpoint {url}: it was interrupted before publish (no {MARKER}); "
                "use the previous iteration's checkpoint"
            )
        raise FileNotFoundError(
            f"no checkpoint at {url}: nothing was saved there (check the URL and the "
            "storage options / AWS_* credentials)"
        )
    marker = storage.read_json(storage.join(url, MARKER), opts)
    if marker.get("format") != FORMAT:
        raise CheckpointError(
            f"{url}: unknown checkpoint format {marker.get('format')!r} (this code reads {FORMAT!r})"
        )
    return marker


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
        optimizer: optional; its state is saved sharded like the parameters.
        lr_scheduler: optional; anything with a JSON-able ``state_dict()`` (e.g. ``LambdaLR``).
        extra: optional JSON dict (step, iteration, ...) returned by ``load_checkpoint``.
        storage_options: fsspec options on top of ``ppoflow.infra.data.storage``'s defaults.

    Returns:
        ``url``, once the checkpoint is published (every rank returns after the marker exists).
    """
    t0, (rank, world), opts = time.perf_counter(), _rank_world(), _options(url, storage_options)
    marker_url = storage.join(url, MARKER)
    fresh = optimizer is not None and not optimizer.state  # never stepped: DCP will init its state
    _, osd, names, state, optim_json = _collect(model, optimizer)
    marker: dict[str, Any] = {
        "format": FORMAT,
        "world_size": world,
        "hf_key_prefix": names.prefix,
        "extra": _enc(dict(extra or {}), "extra"),
        "optimizer": optim_json,
        "lr_scheduler": None,
        "torch": torch.__version__,
    }
    if optim_json is not None:
        optim_json["fresh"] = fresh
    if lr_scheduler is not None:
        marker["lr_scheduler"] = _enc(lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
    if rank == 0 and storage.exists(marker_url, opts):
        storage.rm(marker_url, storage_options=opts)
    _barrier()
    _dcp_call("saving", url, dcp.save, state, storage_writer=_writer(url, opts))
    if fresh:  # get_state_dict ran a zero-grad step to create the state; undo it (step counts matter)
        optimizer.state.clear()
    storage.write_json_atomic(_rng_url(url, rank), _rng_state(), opts)
    _barrier()
    if rank == 0:
        marker["saved_at"] = time.time()
        storage.write_json_atomic(marker_url, marker, opts)
    _barrier()
    _LOG.info("saved checkpoint %s (%d ranks) in %.2fs", url, world, time.perf_counter() - t0)
    return url


def _restore_optim(osd: dict, loaded: dict, saved: dict, names: _Names, url: str) -> None:
    """Put the JSON part (param groups, scalar state) of a saved optimizer into ``osd``."""
    have = [list(g["params"]) for g in osd["param_groups"]]
    groups = [
        {
            **_dec({k: v for k, v in g.items() if k != "params"}),
            "params": [names.from_hf.get(p, p) for p in g["params"]],
        }
        for g in saved["param_groups"]
    ]
    if [sorted(g["params"]) for g in groups] != [sorted(p) for p in have]:
        raise CheckpointError(
            f"checkpoint {url}: the optimizer's parameter groups differ from the saved ones "
            f"({len(have)} groups here, {len(groups)} saved, or other parameters); build the "
            "optimizer the same way as the run that saved it"
        )
    osd["param_groups"] = groups
    for name, st in saved["scalars"].items():
        osd["state"].setdefault(names.from_hf.get(name, name), {}).update(_dec(st))
    for name, st in loaded.items():
        osd["state"][names.from_hf.get(name, name)].update(st)


def load_checkpoint(
    url: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    storage_options: dict | None = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a published checkpoint into ``model`` (+ ``optimizer``, ``lr_scheduler``); collective.

    The model and optimizer may be laid out differently from the saving run (other world size,
    1-D FSDP, HSDP, or no FSDP at all). With ``restore_rng`` and the same world size each rank
    gets its own RNG states back; otherwise RNG is left as it is (see the module docstring).

    Returns the ``extra`` dict given to ``save_checkpoint``. Raises IncompleteCheckpointError (no
    publish marker), FileNotFoundError (nothing at ``url``) or CheckpointError (the checkpoint does
    not match the model/optimizer, or a read failed).
    """
    t0, (rank, world), opts = time.perf_counter(), _rank_world(), _options(url, storage_options)
    marker = read_marker(url, opts)
    if optimizer is not None and marker["optimizer"] is None:
        raise CheckpointError(
            f"checkpoint {url} has no optimizer state (saved with optimizer=None); load "
            "it with optimizer=None and start the optimizer fresh"
        )
    if lr_scheduler is not None and marker["lr_scheduler"] is None:
        raise CheckpointError(f"checkpoint {url} has no LR scheduler state; pass lr_scheduler=None")
    msd, osd, names, state, _ = _collect(model, optimizer)
    # DCP loads in place: the tensors of ``msd``/``osd`` receive the checkpoint's values.
    _dcp_call("loading", url, dcp.load, state, storage_reader=_reader(url, opts))
    if osd is not None:
        _restore_optim(osd, state[_OPTIM], marker["optimizer"], names, url)
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        if marker["optimizer"].get("fresh"):
            optimizer.state.clear()
    else:
        set_model_state_dict(model, msd)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(_dec(marker["lr_scheduler"]))
    if restore_rng:
        if marker["world_size"] == world:
            _set_rng_state(storage.read_json(_rng_url(url, rank), opts))
        elif rank == 0:
            _LOG.warning(
                "checkpoint %s was saved by %d ranks and is loaded on %d: RNG states are not "
                "restored (each rank keeps its current RNG stream)",
                url,
                marker["world_size"],
                world,
            )
    _LOG.info(
        "loaded checkpoint %s (saved by %d ranks) on %d ranks in %.2fs",
        url,
        marker["world_size"],
        world,
        time.perf_counter() - t0,
    )
    return _dec(marker["extra"])


def load_full_state_dict(
    url: str, keys: list[str] | set[str] | None = None, storage_options: dict | None = None
) -> dict[str, torch.Tensor]:
    """Read full (unsharded) model tensors by HF name, in this process only (no collectives, so it
    works with or without a process group and on any subset of ranks).

    ``keys``: HF names to read (``"model.layers.0.mlp.up_proj.weight"``); None = every model tensor
    (tied models hold both ``model.embed_tokens.weight`` and ``lm_head.weight``). Returns
    ``{hf_name: tensor}`` on the CPU, in the dtype the model had when saved.
    """
    opts = _options(url, storage_options)
    read_marker(url, opts)
    reader = _reader(url, opts)
    metadata = reader.read_metadata()
    lead = _MODEL + "."
    available = {k[len(lead) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(lead)}
    wanted = set(available) if keys is None else set(keys)
    missing = sorted(wanted - set(available))
    if missing:
        raise KeyError(
            f"checkpoint {url} has no model tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            f"it has {len(available)} (e.g. {sorted(available)[:3]}); names are Hugging Face names"
        )
    out = {k: torch.empty(available[k].size, dtype=available[k].properties.dtype) for k in sorted(wanted)}
    _dcp_call("reading", url, dcp.load, {_MODEL: out}, storage_reader=reader, no_dist=True)
    return out
