"""The weight sync of a LoRA policy into vLLM: the adapter alone (``actor.lora.sync: adapter``) or
the merged weights (``merged``).

    manager = LoRAShardingManager(rollout, actor_module, sync="adapter", base_model=cfg.model.path)
    with manager:                                   # writes + loads a new adapter if it changed
        out = rollout.generate_sequences(prompts)   # every request carries the adapter's LoRARequest

``adapter``: the engine is built with ``enable_lora=True, max_lora_rank=...`` (:func:`engine_lora_kwargs`)
and keeps the base weights of ``model.path`` for the whole run (on GPU it must sleep at level 1,
which keeps them). Each push writes the adapter's full tensors in PEFT's directory format to a
fresh directory in fast local storage (``/dev/shm`` where it exists), registers it with vLLM under
a fresh integer id (``llm_engine.add_lora``: loaded now, inside the sync's timing) and removes the
previous adapter from the engine and from disk. ``VLLMRollout.lora_request`` is what every
``generate`` then carries. vLLM's prefix cache keys blocks by adapter, so no reset is needed.

``merged``: ``W + (alpha/r) B A`` for every adapted linear, streamed like full weights through
``weight_sync.push_into_engine`` (the engine has no LoRA layers).

Either way the source is the live module: a checkpoint holds only the adapters, and the worker has
loaded them into the module before the manager hears of it (``set_source_checkpoint``).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from typing import Any

from torch import nn

from ppoflow.workers.lora import adapter_tensors, lora_config_of, merged_weights, write_adapter_dir
from ppoflow.workers.rollout import weight_sync
from ppoflow.workers.rollout.sharding_manager import FSDPVLLMShardingManager

__all__ = ["LoRAShardingManager", "engine_lora_kwargs", "VLLM_LORA_RANKS"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
_IDS = itertools.count(1)


def engine_lora_kwargs(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments that serve one adapter of rank ``rank``."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"lora rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}


class LoRAShardingManager(FSDPVLLMShardingManager):
    """``FSDPVLLMShardingManager`` for a policy with LoRA adapters (see the module docstring).

    Args:
        rollout, actor_module: as for ``FSDPVLLMShardingManager`` (the module is required).
        sync: "adapter" or "merged".
        base_model: the base model directory (recorded in each adapter's config).
        kwargs: ``sleep_level``, ``storage_options``, ``quiet``, ``verify`` (``loader`` is always "hf").
    """

    def __init__(self, rollout: Any, actor_module: nn.Module, *, sync: str, base_model: str, **kwargs: Any):
        if sync not in ("adapter", "merged"):
            raise ValueError(f"lora sync must be 'adapter' or 'merged', got {sync!r}")
        kwargs.pop("loader", None)
        super().__init__(rollout, actor_module, loader="hf", **kwargs)
        self.sync, self.base_model = sync, base_model
        lora_cfg = lora_config_of(actor_module)
        if lora_cfg is None:
            raise ValueError("LoRAShardingManager needs a module built with LoRA adapters")
        self.lora_cfg = lora_cfg
        self._dir: str | None = None
        self._adapter: tuple[int, str] | None = None  # (vLLM id, directory) of the adapter served

    def set_source_checkpoint(self, url: str) -> None:
        """The worker loaded the checkpoint's adapters into the module: push from the module."""
        self._source, self._dirty = ("live", None), True

    def push(self) -> dict[str, Any]:
        """Push the module's adapters (or its merged weights) now; collective on every rank."""
        t0 = time.perf_counter()
        assert self.module is not None  # required by __init__ (lora_config)
        if self.sync == "merged":
            stats = weight_sync.push_into_engine(self.rollout, merged_weights(self.module), self.module)
        else:
            stats = self._push_adapter()
        stats.update(source="live", url=None, sync=self.sync, push_s=time.perf_counter() - t0)
        self.last_push = stats
        self._dirty = self._weights_lost = False
        self.pushes += 1
        return stats

    def _push_adapter(self) -> dict[str, Any]:
        from vllm.lora.request import LoRARequest

        tensors = adapter_tensors(self.module)  # type: ignore[arg-type]  # set in __init__
        t0 = time.perf_counter()
        if self._dir is None:
            shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            self._dir = tempfile.mkdtemp(prefix="ppoflow-lora-", dir=shm)
        lora_id = next(_IDS)
        path = write_adapter_dir(
            os.path.join(self._dir, f"adapter-{lora_id}"), tensors, self.lora_cfg, self.base_model
        )
        request = LoRARequest(f"policy-{lora_id}", lora_id, path)
        engine = self.rollout.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter {path}")
        old, self._adapter = self._adapter, (lora_id, path)
        self.rollout.lora_request = request
        if old is not None:
            engine.remove_lora(old[0])
            shutil.rmtree(old[1], ignore_errors=True)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        params = sum(t.numel() for t in tensors.values())
        return {"tensors": len(tensors), "params": params, "bytes": size, "load_s": time.perf_counter() - t0}

    def close(self) -> None:
        """Remove the adapter directories of this manager."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
