"""FSDPVLLMShardingManager: puts the actor's current weights into the rank's vLLM engine.

    manager = build_sharding_manager(rollout, actor_module)
    manager.set_source_checkpoint(url)     # first iteration of a run, or a retry: read DCP shards
    with manager:                          # pushes if the source changed since the last push
        out = rollout.generate_sequences(prompts)
    ...update_actor...
    manager.set_source_live()              # next entry streams from the live FSDP module

The engine is never re-created: weights are loaded in place (``weight_sync.push_into_engine``).

Loaders (``loader=``):
- ``"hf"`` (hf_weight_loader, default): every rank gets each full tensor (live: ``full_tensor()``
  of one DTensor at a time; checkpoint: read by the rank itself) and vLLM's weight loaders narrow
  it to the rank's TP slice. Works for every model vLLM and HF both support.
- ``"dtensor"`` (dtensor_weight_loader, TP > 1 and a live source): each TP rank receives only
  the rows/columns its TP shard holds for the layers where the engine accepts pre-sliced
  tensors; see ``ppoflow.workers.rollout.tp_slicing`` for what vLLM allows and what it does not.

Platforms (chosen with ``vllm.platforms.current_platform``):
- CPU: no sleep mode. Entry: push (``reload_weights`` + tied-head refresh + prefix-cache reset).
  Exit: nothing to free (the KV cache is a fixed host-memory pool).
- GPU: entry: give this process's spare cached blocks back if the engine's pool would not fit
  next to them (training left them in torch's caching allocator; the engine maps its own pool;
  :func:`~ppoflow.workers.device_memory.release_for_wake`) -> ``wake_up(["weights"])`` -> push ->
  ``wake_up(["kv_cache"])``; exit ``sleep(level)`` (which empties torch's cache too).

Sleep levels (GPU). Level 2 discards the weights and the KV cache: nothing is copied anywhere, and
the next entry must push even if the source did not change. Level 1 discards the KV cache and
copies the weights to (pinned) host memory, and copies them back on wake: the next entry pushes
only on a change. When the engine shares its ranks with the trained actor, the actor holds the
newest weights and every rollout after an update pushes them anyway, so level 1 would copy the
old weights out and back for nothing (a 0.5B bf16 model: 1 GB each way per rollout, and that
much pinned host memory per rank): level 2 is the default there (``rollout.sleep_level`` None).
Level 1 pays off for an engine whose weights rarely change between rollouts and that must give
its memory back between them. Level 0 never sleeps: the default of an engine group of its own (the
``rollout`` role: the asynchronous producer, a standalone evaluation), which has no training in
its processes to give memory to. The producer samples a batch in several calls (chunks of
``asynchronous.chunk_tokens``, each continuing the sequences of the call before): awake, each call
finds the KV blocks of the previous one in the prefix cache (unless a new version was pushed in
between, which resets it), where a sleeping engine would copy its weights out and back and
recompute every prompt and every token so far at each call (:func:`engine_sleep_level`).

``last_sync_s``: seconds spent on the last entry (wake + push), 0.0 when nothing was pushed;
``last_timing``: the last entry's ``wake_s`` (both wakes and the cache release), ``release_s``
(the cache release alone), ``push_s``, and the last exit's ``sleep_s``; ``last_push``: the push's stats (source, tensors, params, bytes, load_s).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ppoflow.infra.runtime import faults
from ppoflow.workers.device_memory import release_for_wake
from ppoflow.workers.rollout import weight_sync

if TYPE_CHECKING:
    from ppoflow.workers.rollout.tp_slicing import TPSlicer

__all__ = ["FSDPVLLMShardingManager", "NoOpShardingManager", "engine_sleep_level"]

_LOG = logging.getLogger("ppoflow.rollout")


def engine_sleep_level(configured: int | None, with_trained_actor: bool, serves_adapters: bool) -> int:
    """``rollout.sleep_level``, or when it is None: 2 beside the trained actor (it pushes new weights
    before every rollout), 1 for an engine serving LoRA adapters (its base weights must survive the
    sleep), else 0 (an engine group of its own; see the module docstring)."""
    if configured is not None:
        return configured
    if serves_adapters:
        return 1
    return 2 if with_trained_actor else 0


class NoOpShardingManager:
    """The manager of engines that run on the actor module itself (no ``weight_push``, e.g.
    HFRollout): nothing to sync. Built like every manager, ``(engine, actor_module, **settings)``;
    the settings (``loader``, ``sleep_level``, ...) do not apply to it."""

    def __init__(self, rollout: Any = None, actor_module: Any = None, **settings: Any) -> None:
        self.last_sync_s = 0.0
        self.last_push: dict[str, Any] = {}

    def set_source_checkpoint(self, url: str) -> None:
        """Nothing to do: the actor module already holds the checkpoint's weights (the worker loads them)."""

    def set_source_live(self) -> None:
        """Nothing to do: generation runs on the live module."""

    def __enter__(self) -> NoOpShardingManager:
        self.last_sync_s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FSDPVLLMShardingManager:
    """Context manager that syncs an FSDP actor's weights into a ``VLLMRollout`` engine.

    Args:
        rollout: the rank's ``VLLMRollout``.
        actor_module: the FSDP2 policy root (``PolicyLM``) whose parameter names are HF names;
            may be None when only checkpoint sources are used.
        loader: "hf" (full tensors) or "dtensor" (TP slices where the engine allows; falls back
            to "hf" for checkpoint sources and TP=1).
        sleep_level: GPU sleep level on exit (0: stays awake, 1 or 2); ignored on CPU.
        storage_options: fsspec options for checkpoint URLs.
        verify: check a checkpoint source's files against its marker before reading them
            (``checkpoint.verify``).
        quiet: a context-manager factory held around the entry's wake and push, e.g. the worker's
            ``CheckpointWriter.paused`` (a background checkpoint write in the same process slows
            the push, which is latency-bound Python).
    """

    def __init__(
        self,
        rollout: Any,
        actor_module: nn.Module | None,
        *,
        loader: str = "hf",
        sleep_level: int = 2,
        storage_options: dict | None = None,
        quiet: Callable[[], AbstractContextManager[Any]] | None = None,
        verify: bool = True,
    ):
        if loader not in ("hf", "dtensor"):
            raise ValueError(f"loader must be 'hf' or 'dtensor', got {loader!r}")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level must be 0, 1 or 2, got {sleep_level}")
        self.rollout, self.module = rollout, actor_module
        self.loader, self.sleep_level = loader, sleep_level
        self.storage_options, self.verify = storage_options, verify
        self.quiet = quiet
        self._source: tuple[str, str | None] = ("live", None)
        self._dirty = True  # the engine holds the model_path weights, not (yet) the actor's
        self._weights_lost = False  # GPU level-2 sleep discarded the engine's weights
        self._slicer: TPSlicer | None = None
        self.last_sync_s = 0.0
        self.last_timing: dict[str, float] = {}
        self.last_push: dict[str, Any] = {}
        self.pushes = 0

    # ------------------------------------------------------------------ sources

    def set_source_checkpoint(self, url: str) -> None:
        """The next entry loads the weights of the DCP checkpoint at ``url``."""
        self._source, self._dirty = ("checkpoint", url), True

    def set_source_live(self) -> None:
        """The actor's weights changed: the next entry streams them from the live FSDP module."""
        if self.module is None:
            raise ValueError("set_source_live needs the actor module (the manager was built without one)")
        self._source, self._dirty = ("live", None), True

    @property
    def needs_push(self) -> bool:
        """True when the next entry will push (the source changed, or GPU sleep dropped the weights)."""
        return self._dirty or self._weights_lost

    # ------------------------------------------------------------------ streams

    def _param_names(self) -> list[str] | None:
        if self.module is None:
            return None
        from ppoflow.workers.fsdp_utils import hf_name

        return [hf_name(n) for n, _ in self.module.named_parameters()]

    def _stream(self):
        kind, url = self._source
        if kind == "checkpoint":
            assert url is not None  # set_source_checkpoint(url)
            names = self._param_names()
            return weight_sync.checkpoint_weights(url, names, self.storage_options, verify=self.verify)
        if self.module is None:
            raise ValueError(
                "no weight source: call set_source_checkpoint(url) (the manager has no actor module)"
            )
        if self._sliced():
            assert self._slicer is not None  # made by _sliced()
            return self._slicer.sliced_weights(self.module)
        return weight_sync.live_weights(self.module)

    def _sliced(self) -> bool:
        """True when this push uses the dtensor_weight_loader (live source, TP > 1, loader dtensor)."""
        if self.loader != "dtensor" or self.rollout.tp_size == 1 or self._source[0] != "live":
            return False
        if self.module is None:  # nothing to slice: _stream raises its "no weight source" error
            return False
        if self._slicer is None:
            from ppoflow.workers.rollout.tp_slicing import TPSlicer

            self._slicer = TPSlicer(self.rollout)
        return True

    def push(self) -> dict[str, Any]:
        """Push from the current source now (collective on live sources: call on every rank)."""
        kind, url = self._source
        t0 = time.perf_counter()
        if self._sliced():
            assert self._slicer is not None and self.module is not None  # as _sliced() checked
            self._slicer.prepare(self.module)
            with self._slicer.engine_accepts_slices():
                stats = weight_sync.push_into_engine(self.rollout, self._stream(), self.module)
        else:
            stats = weight_sync.push_into_engine(self.rollout, self._stream(), self.module)
        stats.update(source=kind, url=url, push_s=time.perf_counter() - t0)
        self.last_push = stats
        self._dirty = self._weights_lost = False
        self.pushes += 1
        return stats

    # ------------------------------------------------------------------ context

    def __enter__(self) -> FSDPVLLMShardingManager:
        with self.quiet() if self.quiet is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            pushed = False
            if not self.rollout.cpu:
                release_for_wake(torch.device("cuda", torch.cuda.current_device()))
            t_released = time.perf_counter()
            self.rollout.wake_up(tags=["weights"])
            t1 = time.perf_counter()
            if self.needs_push and not faults.rank_skips(faults.WEIGHT_PUSH):  # drill: stale weights
                self.push()
                pushed = True
            t2 = time.perf_counter()
            self.rollout.wake_up(tags=["kv_cache"])
        if pushed and dist.is_available() and dist.is_initialized() and self._source[0] == "checkpoint":
            dist.barrier()  # checkpoint pushes have no collectives: keep the ranks in step
        t3 = time.perf_counter()
        self.last_sync_s = t3 - t0 if pushed else 0.0
        self.last_timing = {
            "wake_s": (t1 - t0) + (t3 - t2),
            "push_s": t2 - t1,
            "release_s": t_released - t0,
        }
        if pushed:
            _LOG.info(
                "pushed %d tensors (%.1fM params) from %s in %.3f s",
                self.last_push["tensors"],
                self.last_push["params"] / 1e6,
                self._source[0],
                self.last_sync_s,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.last_timing["sleep_s"] = self.sleep()
        return None

    def sleep(self) -> float:
        """GPU: put the engine to sleep at ``sleep_level`` (no-op at level 0, on CPU or when asleep); returns
        the seconds it took. The worker also calls it right after building the engine, so a group
        that starts with an update (a resumed or retried iteration) trains without the engine's
        memory in the way."""
        t0 = time.perf_counter()
        if self.sleep_level and not self.rollout.cpu and not self.rollout.sleeping:
            self.rollout.sleep(level=self.sleep_level)  # vLLM's sleep also empties torch's cache
            self._weights_lost = self.sleep_level >= 2
        return time.perf_counter() - t0
