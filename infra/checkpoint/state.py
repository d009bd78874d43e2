"""What goes into a checkpoint and how it comes back: the tensor trees for DCP, the JSON part for
the marker, the names (Hugging Face names, wrappers' prefixes stripped), and each rank's RNG.

Only tensors go through DCP; everything else is plain JSON (:func:`enc` refuses anything that is
not), so loading never unpickles our data. An optimizer that never stepped stores no tensors at
all (its state is empty; DCP would otherwise materialise zeros the size of two models).
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ppoflow.infra.checkpoint.marker import CheckpointError

__all__ = [
    "MODEL",
    "OPTIM",
    "enc",
    "dec",
    "hf_key_prefix",
    "Names",
    "Collected",
    "collect",
    "restore",
    "RNG",
    "rng_file",
    "rng_state",
    "set_rng_state",
]

MODEL, OPTIM, RNG = "model", "optim", "rng"


def enc(obj: Any, where: str) -> Any:
    """JSON-encode plain data, keeping tuples (``{"__tuple__": [...]}``); tensors are refused."""
    if isinstance(obj, tuple):
        return {"__tuple__": [enc(v, where) for v in obj]}
    if isinstance(obj, list):
        return [enc(v, where) for v in obj]
    if isinstance(obj, dict):
        return {str(k): enc(v, where) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise CheckpointError(
        f"{where}: a {type(obj).__name__} cannot be stored as JSON; checkpoints keep "
        "only tensors (in DCP) and plain JSON values (numbers, strings, lists, dicts)"
    )


def dec(obj: Any) -> Any:
    if isinstance(obj, dict) and set(obj) == {"__tuple__"}:
        return tuple(dec(v) for v in obj["__tuple__"])
    if isinstance(obj, (list, dict)):
        return [dec(v) for v in obj] if isinstance(obj, list) else {k: dec(v) for k, v in obj.items()}
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


class Names:
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


def _split_optim(osd: dict, names: Names) -> tuple[dict, dict]:
    """Optimizer state dict -> (tensors by HF name for DCP, JSON part: param groups + scalars)."""
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        name = names.to_hf.get(fqn, fqn)
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                tensors.setdefault(name, {})[key] = value
            else:
                scalars.setdefault(name, {})[key] = enc(value, f"optimizer state {name}.{key}")
    groups = [
        {
            **{k: enc(v, f"optimizer param_groups[{i}].{k}") for k, v in g.items() if k != "params"},
            "params": [names.to_hf.get(p, p) for p in g["params"]],
        }
        for i, g in enumerate(osd["param_groups"])
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def state_options(model: torch.nn.Module) -> StateDictOptions:
    """The state-dict options of ``model``: a module marked ``checkpoint_trainable_only`` (a LoRA
    model, whose frozen base comes from its model directory again) saves and loads only its
    trainable parameters."""
    only_trainable = bool(getattr(model, "checkpoint_trainable_only", False))
    return StateDictOptions(ignore_frozen_params=only_trainable, strict=not only_trainable)


def _clean(name: str) -> str:
    """A parameter name without the prefixes of activation-checkpoint and compile wrappers."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


@dataclass
class Collected:
    """A model (+ optimizer) as DCP trees and JSON: ``model``/``optim`` are ``{MODEL: ...}`` /
    ``{OPTIM: ...}`` (``optim`` None without optimizer tensors); ``optim_json`` the param groups,
    scalar state and ``fresh`` (never stepped) flag; ``msd``/``osd`` the raw state dicts."""

    names: Names
    model: dict[str, Any]
    optim: dict[str, Any] | None
    optim_json: dict[str, Any] | None
    msd: dict[str, Any]
    osd: dict[str, Any] | None


def collect(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, for_save: bool) -> Collected:
    """The state of ``model`` (+ ``optimizer``) to save (``for_save``), or to load into (DCP loads
    in place).

    Saving an optimizer that never stepped collects no tensors (``fresh``): ``get_state_dict``
    creates its state with a zero-gradient step, which is undone here (step counts matter). To
    load, that created state is what DCP fills.
    """
    fresh = optimizer is not None and not optimizer.state
    opts = state_options(model)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        if fresh and for_save:
            optimizer.state.clear()
    else:
        msd, osd = get_model_state_dict(model, options=opts), None
    if opts.ignore_frozen_params:  # a tied frozen weight stays under its second name: drop it too
        trainable = {_clean(n) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        msd = {k: v for k, v in msd.items() if _clean(k) in trainable}
    names = Names(model, list(msd))
    optim, optim_json = None, None
    if osd is not None:
        tensors, optim_json = _split_optim(osd, names)
        optim_json["fresh"] = fresh
        if not (fresh and for_save):
            optim = {OPTIM: tensors}
    return Collected(names, {MODEL: {names.to_hf[k]: v for k, v in msd.items()}}, optim, optim_json, msd, osd)


def restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    got: Collected,
    saved_optim: dict[str, Any] | None,
    url: str,
) -> None:
    """Put loaded tensors (in ``got``, filled in place by DCP) and the marker's optimizer JSON
    (``saved_optim``) back into ``model`` and ``optimizer``."""
    opts = state_options(model)
    if optimizer is None or got.osd is None:
        set_model_state_dict(model, got.msd, options=opts)
        return
    assert saved_optim is not None  # the marker has it when the checkpoint has an optimizer state
    osd, names = got.osd, got.names
    have = [list(g["params"]) for g in osd["param_groups"]]
    groups = [
        {
            **dec({k: v for k, v in g.items() if k != "params"}),
            "params": [names.from_hf.get(p, p) for p in g["params"]],
        }
        for g in saved_optim["param_groups"]
    ]
    if [sorted(g["params"]) for g in groups] != [sorted(p) for p in have]:
        raise CheckpointError(
            f"checkpoint {url}: the optimizer's parameter groups differ from the saved ones "
            f"({len(have)} groups here, {len(groups)} saved, or other parameters); build the "
            "optimizer the same way as the run that saved it"
        )
    osd["param_groups"] = groups
    if saved_optim.get("fresh"):
        osd["state"] = {}
    else:
        for name, st in saved_optim["scalars"].items():
            osd["state"].setdefault(names.from_hf.get(name, name), {}).update(dec(st))
        for name, st in (got.optim or {}).get(OPTIM, {}).items():
            osd["state"][names.from_hf.get(name, name)].update(st)
    set_state_dict(model, optimizer, model_state_dict=got.msd, optim_state_dict=osd, options=opts)
    if saved_optim.get("fresh"):
        optimizer.state.clear()


def rng_file(rank: int) -> str:
    """Where rank ``rank``'s RNG states lie in a checkpoint, relative to its URL."""
    return f"{RNG}/rank_{rank:05d}.json"


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as JSON: torch CPU, current CUDA device (if used), python, numpy
    (the generators ``ppoflow.infra.remote.rank.seeding.seed_rngs`` seeds)."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: the global MT19937's tuple
    state: dict[str, Any] = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "python": enc(random.getstate(), "python RNG"),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Set this rank's RNGs to ``state`` (from :func:`rng_state`); CUDA's only where CUDA is
    available."""

    def unb64(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(unb64(state["torch_cpu"]))
    random.setstate(dec(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(state["cuda"]))
