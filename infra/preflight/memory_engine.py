"""The rollout engine's part of the memory plan (:mod:`ppoflow.infra.preflight.memory_plan`): on one
actor rank, the engine's weights, KV cache and working memory while awake, and the sleep level that
decides what of it stays on the device between generations.

    engine_memory(cfg, shape, capacity)     # {"weights": ..., "kv_cache": ..., "working": ...}
    engine_sleep_level_of(cfg)               # rollout.sleep_level as the actor group resolves it
"""

from __future__ import annotations

import os

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.models.rollout_engines import engine_spec
from ppoflow.infra.preflight.model_shape import DTYPE_BYTES, ModelShape

__all__ = [
    "GIB",
    "MIB",
    "ENGINE_FIXED_BYTES",
    "POOL_SLACK_BYTES",
    "KV_SHARE_OF_BUDGET",
    "auto_kv_cache_bytes",
    "engine_memory",
    "engine_sleep_level_of",
]

GIB = 2**30
MIB = 2**20

#: The engine's working memory while awake, beside the sampler's logits (``max_num_seqs`` x
#: vocabulary x 8 bytes): prefill activations, CUDA graphs.
ENGINE_FIXED_BYTES = int(1.39 * GIB)
#: vLLM's sleep-mode pool maps each tensor in 2 MiB pages: about 1 MiB lost a tensor.
POOL_SLACK_BYTES = MIB
#: The KV cache's share of the engine's budget (``gpu_memory_utilization`` x device) when ``auto``
#: is capped (``ppoflow.workers.rollout.vllm_engine.KV_SHARE_OF_BUDGET``).
KV_SHARE_OF_BUDGET = 0.75


def auto_kv_cache_bytes(per_token: int, sequences: int, max_model_len: int, cap: int | None) -> int:
    """``rollout.kv_cache_gib: auto`` on GPU, as ``ppoflow.workers.rollout.vllm_engine``'s
    ``auto_kv_cache_bytes`` computes it (16-token blocks and a spare one a sequence, +25%, at
    least 1 GiB, at most ``cap``; a test keeps them equal)."""
    blocks = -(-max_model_len // 16) + 1
    want = max(GIB, int(1.25 * sequences * blocks * 16 * per_token))
    return want if cap is None else max(min(want, cap), min(GIB, cap))


def engine_sleep_level_of(cfg: ExperimentConfig) -> int:
    """``rollout.sleep_level`` as the actor group's engine resolves it (its field's description)."""
    r = cfg.rollout
    if r.sleep_level is not None:
        return r.sleep_level
    lora = cfg.actor.lora
    return 1 if lora.enabled and lora.sync == "adapter" else 2


def engine_memory(cfg: ExperimentConfig, shape: ModelShape, capacity: int | None) -> dict[str, int]:
    """The rollout engine of one actor rank: weights, KV cache, working memory while awake."""
    r, cuda = cfg.rollout, cfg.resources.device == "cuda"
    spec = engine_spec(r.engine)
    tp = r.tensor_model_parallel_size
    replicas = max(1, cfg.resources.nprocs // tp)
    sequences = -(-cfg.data.train_batch_size * r.n // replicas)
    seqs = min(r.engine_seqs(sequences), sequences)
    elem = DTYPE_BYTES[cfg.engine_dtype]
    per_token = shape.kv_bytes_per_token(elem, tp)
    longest = r.prompt_length + r.response_length
    if not spec.can("weight_push"):  # it generates with the actor's module: its cache only
        return {"kv_cache": seqs * longest * per_token}
    weights = shape.params("lm") * elem // tp + (POOL_SLACK_BYTES * shape.engine_tensors() if cuda else 0)
    work = seqs * shape.vocab * 8 + (ENGINE_FIXED_BYTES if cuda else 0)
    if not cuda:  # VLLM_CPU_KVCACHE_SPACE (whole GiB) overrides the setting, as in the engine
        gib = r.kv_cache_gib if isinstance(r.kv_cache_gib, (int, float)) else 0.25
        gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or gib)
        return {"weights": weights, "kv_cache": int(gib * GIB), "working": work}
    if isinstance(r.kv_cache_gib, (int, float)):
        kv = int(r.kv_cache_gib * GIB)
    elif r.kv_cache_gib == "auto":
        cap = None if capacity is None else int(KV_SHARE_OF_BUDGET * r.gpu_memory_utilization * capacity)
        kv = auto_kv_cache_bytes(per_token, seqs, longest, cap)
    else:  # vLLM profiles: the whole share of the device
        share = int(r.gpu_memory_utilization * (capacity or 0))
        kv = max(0, share - weights - work)
    return {"weights": weights, "kv_cache": kv, "working": work}
