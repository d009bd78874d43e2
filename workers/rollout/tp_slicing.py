"""dtensor_weight_loader: hand each vLLM TP rank only the slices of the FSDP parameters it holds.

The hf_weight_loader path gives every rank every full tensor (``full_tensor()``: an all-gather of
the whole parameter) and lets vLLM's weight loaders narrow it to the rank's TP shard. With TP = t,
a rank then receives t times the bytes it keeps. This path moves only what each rank keeps.

What vLLM (0.32, CPU and GPU) allows, found by reading its weight loaders:

- Pre-sliced tensors can go to ``ColumnParallelLinear``, ``MergedColumnParallelLinear`` (per
  packed shard: gate/up), ``QKVParallelLinear`` (per q/k/v, including KV-head replication when
  num_kv_heads < TP) and ``RowParallelLinear`` (weight) — through no public switch, but through
  two per-parameter attributes the loaders read. Unquantized weights are ``BasevLLMParameter``s
  whose (v2) loaders always narrow at ``param.tp_rank * shard_size``: with ``tp_rank = 0`` (the
  state vLLM gives replicated weights) the narrow of a tensor of exactly one shard is the
  identity. Plain parameters (the v1 loaders of the column-parallel biases) honour
  ``is_sharded_weight`` (the flag of vLLM's own pre-sharded loaders) and skip the narrow.
- During ``reload_weights`` the layers are rebuilt from meta-device copies recorded at load time,
  so the attributes must be set on those copies (``LAYERWISE_INFO[layer].restore_metadata``, an
  internal of ``vllm.model_executor.model_loader.reload``) and on the live ``bias`` (never moved
  to meta). :meth:`TPSlicer.engine_accepts_slices` sets them for one push and restores them after.
- NOT sliceable: ``VocabParallelEmbedding``/``ParallelLMHead`` (their loader always narrows a
  full vocabulary tensor and ignores the flag), norms and other replicated parameters, quantized
  layers (other loaders), the row-parallel bias (replicated), and a parameter with a loader of its
  own (Qwen3-Next's delta-net convolution: it shards its q, k and v parts separately). These still
  go as full tensors.
- The public alternative, ``reload_weights(is_checkpoint_format=False)`` (tensors already in
  kernel format and sharded, copied straight into the parameters), works on GPU for unquantized
  models (fused qkv/gate_up built by the caller) but not on CPU, where the kernel format of a
  linear layer is a pre-packed oneDNN/SGL handle and the plain ``weight`` is an empty tensor.

Moving the slices: FSDP2 shards every parameter along dim 0 in ``ceil(N / W)``-row chunks over
its mesh. Each rank's needed slice (computed by its own engine and all-gathered once as integers)
is assembled with one ``all_to_all_single`` per parameter: rank r sends rank q the rows of its
chunk that fall in q's slice (restricted to q's columns for row-parallel weights). A rank receives
exactly the bytes of its slice. Supported when the parameter is a DTensor ``Shard(0)`` on a 1-D
mesh; anything else (HSDP 2-D meshes, plain tensors) falls back to ``full_tensor()``.
Checkpoint sources use the hf path (each rank reads full tensors itself, no collectives).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TPSlicer", "slice_specs_rpc"]

# Spec of a slice: (dim, start, size); dim = -1 means "the full tensor".
_FULL = (-1, 0, 0)


def _find(model: nn.Module, hf_module: str) -> tuple[nn.Module | None, str, Any]:
    """The vLLM module holding HF module ``hf_module``: (module, vllm path, packed shard id or None)."""
    modules = dict(model.named_modules())
    if hf_module in modules:
        return modules[hf_module], hf_module, None
    parent, _, leaf = hf_module.rpartition(".")
    for packed, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts and f"{parent}.{packed}" in modules:
            mod = modules[f"{parent}.{packed}"]
            idx = parts.index(leaf)
            shard = ["q", "k", "v"][idx] if type(mod).__name__.startswith("QKV") else idx
            return mod, f"{parent}.{packed}", shard
    return None, "", None


def _spec(mod: nn.Module, param: str, shard: Any) -> tuple[int, int, int]:
    """(dim, start, size) of this TP rank's slice of an HF tensor loaded into ``mod.<param>``."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        UnquantizedLinearMethod,
    )

    if not isinstance(getattr(mod, "quant_method", None), UnquantizedLinearMethod) or mod.tp_size == 1:
        return _FULL
    if not _standard_loader(mod, getattr(mod, param, None)):
        return _FULL
    if isinstance(mod, QKVParallelLinear) and shard in ("q", "k", "v"):
        if shard == "q":
            size = mod.num_heads * mod.head_size
            return 0, mod.tp_rank * size, size
        size = mod.num_kv_heads * (mod.head_size if shard == "k" else mod.v_head_size)
        return 0, (mod.tp_rank // mod.num_kv_head_replicas) * size, size
    if isinstance(mod, MergedColumnParallelLinear) and isinstance(shard, int):
        size = mod.output_sizes[shard] // mod.tp_size
        return 0, mod.tp_rank * size, size
    if type(mod) is ColumnParallelLinear and shard is None:
        return 0, mod.tp_rank * mod.output_size_per_partition, mod.output_size_per_partition
    if type(mod) is RowParallelLinear and shard is None and param == "weight":
        return 1, mod.tp_rank * mod.input_size_per_partition, mod.input_size_per_partition
    return _FULL


def _standard_loader(mod: nn.Module, tensor: Any) -> bool:
    """Whether ``tensor`` is loaded by its layer's own loader (which takes pre-sliced tensors as
    described in the module docstring), not by a loader of its own that expects the full tensor
    and shards it its own way (Qwen3-Next's delta-net ``conv1d.weight``: its q, k and v parts each
    split across the TP ranks, not one contiguous block)."""
    loader = getattr(tensor, "weight_loader", None)
    return loader is None or getattr(loader, "__self__", None) is mod


def slice_specs_rpc(worker: Any, hf_names: list[str]) -> dict[str, Any]:
    """vLLM worker RPC: this TP rank's slice spec per HF name, and the vLLM parameters to flag."""
    model = worker.model_runner.get_model()
    specs, flag = [], []
    for name in hf_names:
        hf_module, _, param = name.rpartition(".")
        mod, path, shard = _find(model, hf_module)
        spec = _FULL if mod is None else _spec(mod, param, shard)
        specs.append(list(spec))
        if spec != _FULL:
            flag.append(f"{path}.{param}")
    return {"specs": specs, "flag": sorted(set(flag))}


def set_sharded_flag_rpc(worker: Any, paths: list[str], value: bool) -> int:
    """vLLM worker RPC: make the loaders of ``paths`` take pre-sliced tensors (``value``) or not.

    ``BasevLLMParameter`` weights (the v2 loaders: always narrow at ``param.tp_rank * shard``) get
    ``tp_rank = 0`` — the state vLLM gives replicated weights — so the narrow of an exactly
    shard-sized tensor is the identity; plain parameters (v1 loaders, e.g. biases) get
    ``is_sharded_weight``. Both on the meta copies reload rebuilds the layer from and on the live
    parameters; ``value=False`` restores the layer's own ``tp_rank`` and drops the flag.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.parameter import BasevLLMParameter

    model = worker.model_runner.get_model()
    modules = dict(model.named_modules())
    done = 0
    for path in paths:
        mod_path, _, param = path.rpartition(".")
        mod = modules[mod_path]
        for t in (getattr(mod, param, None), get_layerwise_info(mod).restore_metadata[0].get(param)):
            if not isinstance(t, torch.Tensor):
                continue
            flagged: Any = t  # vLLM's loaders read these ad-hoc attributes off the tensor
            if isinstance(t, BasevLLMParameter) or "tp_rank" in t.__dict__:
                flagged.tp_rank = 0 if value else mod.tp_rank
            elif value:
                flagged.is_sharded_weight = True
            elif "is_sharded_weight" in t.__dict__:
                del flagged.is_sharded_weight
            done += 1
    return done


def _fsdp_rows(dtensor) -> tuple[int, int] | None:
    """Row range [lo, hi) of the full tensor held by this rank, for a Shard(0) DTensor on 1-D mesh."""
    from torch.distributed.tensor import Shard

    if dtensor.device_mesh.ndim != 1 or tuple(dtensor.placements) != (Shard(0),):
        return None
    n, w = dtensor.shape[0], dtensor.device_mesh.size()
    chunk = -(-n // w)
    r = dtensor.device_mesh.get_local_rank()
    lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
    return (lo, hi) if dtensor.to_local().shape[0] == hi - lo else None


def _region(spec: list[int], shape: torch.Size) -> list[tuple[int, int]]:
    """Per-dim [lo, hi) of a spec over a tensor of ``shape``."""
    region = [(0, s) for s in shape]
    dim, start, size = spec
    if dim >= 0:
        region[dim] = (start, start + size)
    return region


class TPSlicer:
    """Streams ``(hf_name, tensor)`` where TP-sharded tensors are only this rank's slice.

    Built once per engine (an RPC asks the engine for its slice layout); ``sliced_weights`` is a
    collective over the FSDP mesh, like ``full_tensor()``.
    """

    def __init__(self, rollout: Any):
        self.rollout = rollout
        self._names: list[str] | None = None
        self._specs: torch.Tensor | None = None  # (world, n_params, 3)
        self._flag: list[str] = []

    @staticmethod
    def _params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        from ppoflow.workers.fsdp_utils import hf_name

        return [(hf_name(n), p) for n, p in module.named_parameters()]

    def prepare(self, module: nn.Module) -> None:
        """Ask the engine for every rank's slices of ``module``'s parameters (collective, once)."""
        names = [n for n, _ in self._params(module)]
        if self._names == names:
            return
        out = self.rollout.collective_rpc(slice_specs_rpc, kwargs={"hf_names": names})[0]
        mine = torch.tensor(out["specs"], dtype=torch.long).reshape(len(names), 3)
        world = dist.get_world_size()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        self._names, self._specs, self._flag = names, torch.stack(gathered), out["flag"]

    @contextlib.contextmanager
    def engine_accepts_slices(self):
        """Let the sliced vLLM parameters take pre-sliced tensors for the duration of one push."""
        if self._names is None:
            raise RuntimeError("TPSlicer.prepare(module) must run before engine_accepts_slices()")
        self.rollout.collective_rpc(set_sharded_flag_rpc, kwargs={"paths": self._flag, "value": True})
        try:
            yield
        finally:
            self.rollout.collective_rpc(set_sharded_flag_rpc, kwargs={"paths": self._flag, "value": False})

    def sliced_weights(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``weight_sync.live_weights``, with TP-sharded tensors cut to this rank's slice."""
        from torch.distributed.tensor import DTensor

        from ppoflow.workers.fsdp_utils import full_param, reshard_all

        self.prepare(module)
        assert self._specs is not None  # set by prepare()
        reshard_all(module)
        for i, (name, param) in enumerate(self._params(module)):
            specs = self._specs[:, i].tolist()
            rows = _fsdp_rows(param) if isinstance(param, DTensor) else None
            if (
                all(s[0] < 0 for s in specs)
                or rows is None
                or cast(DTensor, param).device_mesh.size() != dist.get_world_size()  # rows: a DTensor
            ):
                yield name, full_param(param)
                continue
            yield name, self._exchange(param, rows, specs)

    def _exchange(self, param, rows: tuple[int, int], specs: list[list[int]]) -> torch.Tensor:
        """all_to_all_single: send each rank the part of my rows inside its slice; get mine."""
        from ppoflow.workers.fsdp_utils import local_shard

        local = local_shard(param).detach()  # a CPU-offloaded shard of a CUDA mesh: exchanged on the GPU
        shape, world, me = param.shape, len(specs), dist.get_rank()
        chunk = -(-shape[0] // world)
        sends, send_sizes = [], []
        for q in range(world):
            reg = _region(specs[q], shape)
            lo, hi = max(rows[0], reg[0][0]), min(rows[1], reg[0][1])
            piece = local[max(lo, 0) - rows[0] : max(hi, lo) - rows[0]]
            if len(reg) > 1:
                piece = piece[:, reg[1][0] : reg[1][1]]
            sends.append(piece.reshape(-1))
            send_sizes.append(piece.numel())
        mine = _region(specs[me], shape)
        recv_sizes, recv_shapes = [], []
        for r in range(world):
            lo_r, hi_r = min(r * chunk, shape[0]), min((r + 1) * chunk, shape[0])
            lo, hi = max(lo_r, mine[0][0]), min(hi_r, mine[0][1])
            n_rows = max(hi - lo, 0)
            tail = [b - a for a, b in mine[1:]]
            recv_shapes.append([n_rows, *tail])
            recv_sizes.append(n_rows * int(torch.tensor(tail).prod()) if tail else n_rows)
        out = torch.empty(sum(recv_sizes), dtype=local.dtype, device=local.device)
        send = torch.cat(sends) if sends else torch.empty(0, dtype=local.dtype, device=local.device)
        dist.all_to_all_single(
            out,
            send,
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=param.device_mesh.get_group(),
        )
        parts = [p.reshape(s) for p, s in zip(out.split(recv_sizes), recv_shapes)]
        return torch.cat(parts, dim=0)
