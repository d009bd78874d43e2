"""VLLMRollout: a vLLM engine inside each worker rank (SPMD), sampling from token-id prompts.

Layout. Every rank of the worker group builds one ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"``: vLLM joins the torch.distributed world the
launcher already initialised (torchrun's RANK/LOCAL_RANK/MASTER_* variables) instead of starting
processes of its own, and forms tensor-parallel groups of ``tensor_model_parallel_size``
consecutive ranks. Data parallel = world_size / TP: ``dp_rank = rank // tp``, ``tp_rank = rank % tp``.

Data. The dispatcher gives every rank its own equal-sized chunk of prompt rows (chunked by world
rank, whatever the TP size, so the FSDP actor recomputes log-probs and trains on all ranks). With
TP > 1 the ranks of a TP group all-gather their prompt tensors (``input_ids``/``attention_mask``;
plain tensor collectives on vLLM's CPU TP group, nothing pickled), every TP rank generates the
whole group's prompts (vLLM needs identical requests on its TP ranks) and keeps only its own rows
of the output, so the outputs concatenated in rank order are in input order. A replica's rows are
therefore the same consecutive rows, with the same per-row seeds, as if each replica had been
handed its ``dp_rank``'s chunk: the rollout does not depend on how the rows reached the engine.

Seeds. ``LLM(seed=config.seed + dp_rank)`` (it also reseeds the rank's global RNGs), and every
sampled request carries its own seed, ``request_seed(config.seed, dp_rank, call number, row)`` —
or ``meta_info["seed"]`` in place of the call number, for rollouts that must repeat exactly on a
retry. DP replicas sample different streams; the TP ranks of one engine use the same seeds
(external_launcher needs every TP rank to draw the same tokens), and per-request generators
keep them in step whatever else in the rank consumes the global torch RNG between rollouts.

Log-probs. The engine is built with ``logprobs_mode="processed_logprobs"``: the reported
log-prob of a sampled token is taken after temperature (and after top-k/top-p truncation, if
those are on), i.e. from the distribution the token was drawn from. vLLM's default
(``raw_logprobs``) would be the temperature-1 log-probs. Greedy decoding reports temperature-1
log-probs.

The engine's settings and its start, with what vLLM needs of them, are in
``ppoflow.workers.rollout.vllm_engine``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ppoflow.infra.config import RolloutConfig
from ppoflow.infra.runtime.host_cpu import cpu_use
from ppoflow.workers.rollout.base import (
    EngineSite,
    Rollout,
    SamplingSettings,
    TurnSamples,
    assemble_output,
    check_prompts,
    generation_metrics,
    prompt_token_lists,
    request_seed,
)
from ppoflow.workers.rollout.gc_heap import frozen_heap
from ppoflow.workers.rollout.vllm_engine import (
    auto_kv_cache_bytes,
    check_world,
    completions,
    engine_kwargs_for,
    is_cpu_platform,
    keep_engine,
    kv_bytes_per_token,
    kv_cap_bytes,
    sampled_log_probs,
    set_engine_env,
    start_engine,
    tp_cpu_group,
    warm_up,
)

__all__ = ["VLLMRollout", "request_seed"]


class VLLMRollout(Rollout):
    """One vLLM engine per rank; see the module docstring for layout, seeds and log-probs.

    Args:
        config: the ``rollout`` section.
        model_path: HF model directory (architecture, and the weights loaded at start-up unless
            ``load_format="dummy"``; the sharding manager overwrites them before every rollout).
        tokenizer_path: the tokenizer directory (default ``model_path``).
        pad_token_id: right-padding value of ``responses``.
        rank, world_size: this rank in the torch.distributed world (already initialised when
            ``world_size > 1``).
        dtype: engine dtype ("float32", "bfloat16", ...).
        load_format: vLLM load format ("auto", or "dummy" when the first push always comes before
            the first rollout).
        sequences: the most sequences this engine holds at once (its share of a rollout); sizes the
            GPU KV cache when ``rollout.kv_cache_gib`` is "auto" and ``max_num_seqs`` when "auto".
        engine_kwargs: extra ``vllm.LLM`` keyword arguments (override the derived ones).
        warmup: run one tiny request at start-up (compiles vLLM's log-prob kernel outside the
            first rollout's timing).
    """

    def __init__(
        self,
        config: RolloutConfig,
        *,
        model_path: str,
        rank: int = 0,
        world_size: int = 1,
        dtype: str = "float32",
        tokenizer_path: str | None = None,
        pad_token_id: int = 0,
        trust_remote_code: bool = False,
        load_format: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        warmup: bool = True,
        sequences: int | None = None,
    ):
        distributed = check_world(config.tensor_model_parallel_size, rank, world_size)
        self.config = config
        self.rank, self.world_size = rank, world_size
        tp = config.tensor_model_parallel_size
        self.tp_size, self.dp_size = tp, world_size // tp
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.pad_token_id = pad_token_id
        set_engine_env()
        self.cpu = is_cpu_platform()
        kwargs = self._llm_kwargs(
            model_path,
            tokenizer_path or model_path,
            dtype,
            trust_remote_code,
            load_format,
            distributed,
            sequences,
            engine_kwargs or {},
        )
        self.cuda_graphs = not kwargs["enforce_eager"]
        self.kv_cache_bytes = kwargs.get("kv_cache_memory_bytes")
        self.llm, self.engine_init_s = start_engine(kwargs, cpu=self.cpu, tp_size=tp, distributed=distributed)
        self._tp_group = tp_cpu_group(tp, self.tp_rank, rank) if tp > 1 else None
        self.sleeping = False
        self.calls = 0
        self.lora_request: Any = None  # the adapter every request carries (a LoRA policy's sync sets it)
        self.warmup_s = warm_up(self.llm, pad_token_id) if warmup else 0.0

    @classmethod
    def from_config(cls, config: Any, site: EngineSite, **engine_kwargs: Any) -> VLLMRollout:
        """``rollout.engine: vllm`` on ``site``'s rank; ``engine_kwargs`` go to the constructor (``sequences``:
        this replica's share of ``data.train_batch_size * rollout.n``; ``max_model_len``: an evaluation's
        longer responses fit too; with ``actor.lora.sync: adapter`` vLLM is built to serve the adapter)."""
        rcfg, model, lora = config.rollout, config.model, config.actor.lora
        extra = {"max_model_len": config.engine_max_model_len(), **(engine_kwargs.get("engine_kwargs") or {})}
        if lora.enabled and lora.sync == "adapter":
            from ppoflow.workers.rollout.lora_sync import engine_lora_kwargs

            extra = {**engine_lora_kwargs(lora.rank), **extra}
        engine_kwargs["engine_kwargs"] = extra
        replicas = max(1, site.world_size // rcfg.tensor_model_parallel_size)
        engine_kwargs.setdefault("sequences", -(-config.data.train_batch_size * rcfg.n // replicas))
        return cls(
            rcfg,
            model_path=site.model_path,
            rank=site.rank,
            world_size=site.world_size,
            dtype=config.engine_dtype,
            tokenizer_path=model.tokenizer_path or site.model_path,
            pad_token_id=site.pad_token_id,
            trust_remote_code=model.trust_remote_code,
            **engine_kwargs,
        )

    # ------------------------------------------------------------------ engine

    def _llm_kwargs(
        self,
        model_path: str,
        tokenizer_path: str,
        dtype: str,
        trust_remote_code: bool,
        load_format: str,
        distributed: bool,
        sequences: int | None,
        overrides: dict[str, Any],
    ) -> dict[str, Any]:
        """``vllm.LLM``'s keyword arguments: the model, the launcher's world when there is one, the
        ``rollout`` section's settings (``engine_kwargs_for``), then ``overrides``."""
        kwargs: dict[str, Any] = dict(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            load_format=load_format,
        )
        if distributed:
            kwargs["distributed_executor_backend"] = "external_launcher"
        kv_bytes = self._auto_kv_bytes(model_path, trust_remote_code, dtype, sequences)
        settings = engine_kwargs_for(
            self.config,
            cpu=self.cpu,
            tp_size=self.tp_size,
            dp_rank=self.dp_rank,
            kv_bytes=kv_bytes,
            sequences=sequences,
        )
        kwargs.update({**settings, **overrides})
        return kwargs

    def _auto_kv_bytes(
        self, model_path: str, trust_remote_code: bool, dtype: str, sequences: int | None
    ) -> int | None:
        """The GPU KV budget of ``rollout.kv_cache_gib: auto``: this engine's share of the batch
        (``sequences``, at most ``max_num_seqs``) at full length, capped; None on CPU or for other settings."""
        config = self.config
        if self.cpu or config.kv_cache_gib != "auto":
            return None
        seqs = min(config.engine_seqs(sequences), sequences or config.engine_seqs(sequences))
        per_token = kv_bytes_per_token(model_path, trust_remote_code, dtype, self.tp_size)
        cap = kv_cap_bytes(config.gpu_memory_utilization)
        return auto_kv_cache_bytes(per_token, seqs, config.prompt_length + config.response_length, cap=cap)

    @property
    def block_size(self) -> int:
        """KV-cache block size in tokens (prefix caching reuses whole blocks)."""
        return int(self.llm.llm_engine.vllm_config.cache_config.block_size)

    def describe(self) -> dict[str, Any]:
        """The engine's layout and budgets as vLLM settled them (JSON; for init_model's summary)."""
        vc = self.llm.llm_engine.vllm_config
        return {
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "cuda_graphs": self.cuda_graphs,
            "kv_cache_budget_gib": None
            if self.kv_cache_bytes is None
            else round(self.kv_cache_bytes / 2**30, 3),
            "kv_cache_blocks": getattr(vc.cache_config, "num_gpu_blocks", None),
            "block_size": self.block_size,
            "max_num_seqs": getattr(vc.scheduler_config, "max_num_seqs", None),
            "max_num_batched_tokens": getattr(vc.scheduler_config, "max_num_batched_tokens", None),
            "engine_init_s": round(self.engine_init_s, 3),
        }

    def collective_rpc(self, method, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker method (name or ``fn(worker, ...)``) on this rank's engine worker."""
        return self.llm.collective_rpc(method, kwargs=kwargs)

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (needed after a weight change: they hold old-weight keys/values)."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def sleep(self, level: int = 2) -> None:
        """GPU: free the KV cache (and with level 2 the weights); no-op on CPU (no sleep mode)."""
        if not self.cpu and not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """GPU: re-allocate ``tags`` ("weights", "kv_cache"; None = all); no-op on CPU."""
        if not self.cpu and self.sleeping:
            awake = self.llm.wake_up(tags=tags)  # vLLM >= 0.11: True once every allocation is back
            self.sleeping = not awake if isinstance(awake, bool) else not (tags is None or "kv_cache" in tags)

    # ------------------------------------------------------------------ generation

    def _gather_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate the TP group's equal-sized (B, P) chunks in TP-rank order."""
        if self._tp_group is None:
            return tensor
        shape = torch.tensor(list(tensor.shape), dtype=torch.long)
        shapes = [torch.empty_like(shape) for _ in range(self.tp_size)]
        dist.all_gather(shapes, shape, group=self._tp_group)
        if any(not torch.equal(s, shape) for s in shapes):
            raise ValueError(
                f"TP ranks hold prompt chunks of different shapes {[s.tolist() for s in shapes]}: the "
                "dispatcher must pad the batch to a multiple of the world size"
            )
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self._tp_group)
        return torch.cat(parts, dim=0)

    def _sampling_params(self, s: SamplingSettings, n_prompts: int, meta_seed: Any, log_probs: bool) -> list:
        """One ``SamplingParams`` per prompt; sampled requests carry their own seed (see ``request_seed``)."""
        from vllm import SamplingParams

        common: dict[str, Any] = dict(
            n=s.n,
            temperature=s.temperature if s.do_sample else 0.0,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.response_length,
            detokenize=False,
        )
        if log_probs:
            common.update(logprobs=0, flat_logprobs=True)
        if not s.do_sample:
            return [SamplingParams(**common)] * n_prompts
        base = (
            (self.config.seed, self.dp_rank, "call", self.calls)
            if meta_seed is None
            else (self.config.seed, self.dp_rank, "seed", meta_seed)
        )
        return [SamplingParams(seed=request_seed(*base, i), **common) for i in range(n_prompts)]

    def generate_sequences(self, prompts):
        """Sample ``n`` responses for each of this rank's prompt rows (see ``ppoflow.workers.rollout.base``)."""
        if self.sleeping:
            raise RuntimeError("the vLLM engine is asleep: generate inside the sharding manager's context")
        settings = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_prompts(prompts)
        token_lists = self._engine_prompts(prompts, settings)
        t0 = time.perf_counter()
        want_lp = self.config.calculate_log_probs
        params = self._sampling_params(settings, len(token_lists), prompts.meta_info.get("seed"), want_lp)
        self.calls += 1
        outs, t_gen, gc_time, cpu = self._decode(token_lists, params)
        generate_s = time.perf_counter() - t0
        bsz = len(prompts)
        responses, log_probs = completions(outs[self.tp_rank * bsz : (self.tp_rank + 1) * bsz], want_lp)
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        # rollout/gc_s: the collection before the freeze and any inside generate
        extra = {"rollout/gc_s": gc_time.seconds, "rollout/prepare_s": t_gen - t0}
        metrics = generation_metrics(generate_s, generated, cpu, extra)
        return assemble_output(prompts, responses, log_probs, settings, self.pad_token_id, metrics)

    def sample_turn(
        self,
        contexts: list[list[int]],
        limits: list[int],
        episode_ids: list[int],
        turn: int,
        settings: SamplingSettings,
        meta_seed: Any,
        call: int,
    ) -> TurnSamples:
        """One turn of multi-turn episodes (see ``Rollout.sample_turn``): one request per context,
        seeded ``request_seed(seed, dp_rank, call or meta seed, "episode", e, "turn", t)``."""
        from vllm import SamplingParams

        s, want_lp = settings, self.config.calculate_log_probs
        limit = self.llm.llm_engine.vllm_config.model_config.max_model_len
        if contexts and max(len(c) + m for c, m in zip(contexts, limits)) > limit:
            raise ValueError(f"a multi-turn episode would pass the engine's max_model_len {limit}")
        base = (self.config.seed, self.dp_rank) + (
            ("call", call) if meta_seed is None else ("seed", meta_seed)
        )
        params = []
        for ep, m in zip(episode_ids, limits):
            kw: dict[str, Any] = dict(
                n=1,
                temperature=s.temperature if s.do_sample else 0.0,
                top_p=s.top_p,
                top_k=s.top_k,
                max_tokens=m,
                detokenize=False,
            )
            if want_lp:
                kw.update(logprobs=0, flat_logprobs=True)
            if s.do_sample:
                kw["seed"] = request_seed(*base, "episode", ep, "turn", turn)
            params.append(SamplingParams(**kw))
        outs, _, _, _ = self._decode(contexts, params)
        result: TurnSamples = []
        for out in outs:
            toks = list(out.outputs[0].token_ids)
            result.append((toks, sampled_log_probs(out.outputs[0], toks) if want_lp else None))
        return result

    def _engine_prompts(self, prompts, settings: SamplingSettings) -> list[list[int]]:
        """The unpadded prompts of the TP group's rows (this rank's among them, in rank order),
        checked to fit the engine's ``max_model_len`` with the response."""
        ids = self._gather_tp(prompts.batch["input_ids"].cpu().long())
        mask = self._gather_tp(prompts.batch["attention_mask"].cpu().long())
        token_lists = prompt_token_lists(ids, mask)
        too_long = max(len(t) for t in token_lists) + settings.response_length
        limit = self.llm.llm_engine.vllm_config.model_config.max_model_len
        if too_long > limit:
            raise ValueError(
                f"prompt + response_length = {too_long} tokens exceeds the engine's max_model_len "
                f"{limit} (rollout.prompt_length + rollout.response_length, or evaluation.response_length)"
            )
        return token_lists

    def _decode(self, token_lists: list[list[int]], params: list) -> tuple[list, float, Any, Any]:
        """``llm.generate`` with the garbage collector's heap frozen (``gc_heap``) and the global RNG
        forked; returns (the outputs, when generate started, the GC timer, the CPU it got)."""
        from vllm.inputs import TokensPrompt

        # Every request carries its own seed; the engine must not also move the rank's global RNG,
        # which checkpoints save per rank: a group rebuilt from checkpoint n-1 would otherwise save
        # checkpoint n with another RNG state than a group that kept running (resume must be exact).
        rng_devices = (
            [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        )
        requests = [TokensPrompt(prompt_token_ids=t) for t in token_lists]
        with frozen_heap() as gc_time, torch.random.fork_rng(devices=rng_devices):
            t_gen = time.perf_counter()
            with cpu_use() as cpu:  # what CPU the decoding got (infra/runtime/host_cpu.py)
                outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
        return outs, t_gen, gc_time, cpu

    def shutdown(self) -> None:
        """Keep the engine (:func:`keep_engine`): it dies with the rank's process, after the rank
        destroyed the process group, and vLLM's exit hook never runs against a destroyed group."""
        keep_engine(self.llm)
