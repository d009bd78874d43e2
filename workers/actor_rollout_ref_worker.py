"""ActorRolloutRefWorker: the policy side of PPO in one worker class.

Config given to the group: ``{"config": ExperimentConfig as JSON dict (or string), "role": ...}``
with role one of the modes of ``ACTOR_ROLE`` (``ppoflow.infra.remote.contracts.WorkerMode``:
``actor_rollout_ref``, the hybrid engine, ``actor_rollout``, ``actor_ref``, ``actor``, ``rollout``,
``ref``), what the worker builds; a mode with the actor may end in ``+teacher``: a frozen teacher
too (``ppoflow.workers.teacher``).

The driver calls the ``@register`` methods as ``ActorContract`` says (``ppoflow.infra.remote.contracts``:
each method's arguments, dispatch mode and what comes back; ``tests/infra/remote/test_contracts.py``
holds the two to each other).

Data parallelism: every DP_COMPUTE_PROTO method is dispatched over all ranks (``dp_rank = rank``,
``dp_size = world_size``), whatever the rollout engine's tensor parallelism. With vLLM TP = t the
engine's replicas span t consecutive ranks; ``generate_sequences`` still gets one chunk per rank
and the rollout gathers its TP group's chunks into one engine batch (see
``ppoflow.workers.rollout.vllm_rollout``), so the old log-probs, the reference log-probs and the
PPO update all run data-parallel over every rank.

Sequence parallelism (``actor.sequence_parallel_size`` = sp > 1; the reference's must match in a
worker that holds both): the ranks form ``world / sp`` groups of sp consecutive ranks
(``ppoflow.workers.sequence_parallel``); ``init_model`` sets ``dp_rank = rank // sp``,
``dp_size = world / sp`` and only the group's first rank returns DataProtos, so the ranks of a
group get the same rows and split each packed micro-batch's tokens between them. Generation
still uses every rank: each rank of a group samples 1/sp of the group's prompts and the group
gathers the rollouts before the old log-probs.

On CUDA the methods report the rank's peak memory per phase (``perf/mem/*_gib``,
``ppoflow.workers.device_memory``) and the engine's wake/push/sleep seconds.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Any

from ppoflow.infra.config import FSDPConfig
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.contracts import ACTOR_ROLE, WorkerMode
from ppoflow.infra.remote.rank.seeding import preserved_rngs, seed_rngs
from ppoflow.infra.remote.rank.worker import Dispatch, Worker, register
from ppoflow.workers.actor import DataParallelPPOActor
from ppoflow.workers.checkpointing import CheckpointMethods
from ppoflow.workers.determinism import deterministic_updates
from ppoflow.workers.device_memory import GIB, PeakMemory, engine_pool_bytes, resident_gib
from ppoflow.workers.fsdp_utils import build_fsdp_model, build_mesh, mesh_info
from ppoflow.workers.lora import adapters_off, with_adapters
from ppoflow.workers.modeling import PolicyLM
from ppoflow.workers.optim import build_optimizer, optimizer_kernel, optimizer_state_on
from ppoflow.workers.rollout.episodes import EPISODE_METRIC_RULES
from ppoflow.workers.sequence_parallel import SequenceParallel
from ppoflow.workers.teacher import TeacherMethods, split_teacher_role
from ppoflow.workers.worker_setup import parse_worker_config

__all__ = ["ActorRolloutRefWorker", "ROLES"]

#: The modes this worker builds in (``ACTOR_ROLE``'s), as its config's ``role`` says them.
ROLES = tuple(mode.value for mode in ACTOR_ROLE.modes)


class ActorRolloutRefWorker(CheckpointMethods, TeacherMethods, Worker):
    """Actor (FSDP policy + AdamW), rollout engine and reference policy on the ranks of one group."""

    def __init__(self, config: dict[str, Any]):
        config, self.with_teacher = split_teacher_role(config)
        super().__init__(config)
        self.cfg, self.role = parse_worker_config(config, ROLES, ACTOR_ROLE.default.wire)
        mode = WorkerMode(self.role)
        self.is_actor, self.is_rollout, self.is_ref = mode.builds_actor, mode.builds_rollout, mode.builds_ref
        self.actor: DataParallelPPOActor | None = None
        self.ref: DataParallelPPOActor | None = None
        self.rollout: Any = None
        self.sharding_manager: Any = None
        self.tokenizer: Any = None
        self._meshes: dict[int, Any] = {}
        self._ref_is_base = False
        self.sp = SequenceParallel(size=1, rank=0, dp_rank=self.dp_rank, dp_size=self.dp_size)
        self._init_checkpoints()

    # ------------------------------------------------------------------ building
    def _mesh(self, fsdp_cfg: FSDPConfig):
        """One device mesh per shard size, shared by the actor and the reference."""
        size = fsdp_cfg.fsdp_size if fsdp_cfg.fsdp_size != -1 else self.world_size
        if size not in self._meshes:
            self._meshes[size] = build_mesh(fsdp_cfg, self.world_size, self.device.type)
        return self._meshes[size]

    def _build_policy(
        self, fsdp_cfg: FSDPConfig, trainable: bool, packed: bool, adapters: bool = True, model: Any = None
    ) -> tuple[PolicyLM, dict[str, Any]]:
        """The base model (or ``model``, a model section) as a sharded ``PolicyLM`` (rank 0 reads the
        weights, the others get shards); ``packed``: with the attention packed forwards need;
        ``adapters``: with ``actor.lora``'s adapters when it is on (the base frozen)."""
        mesh = self._mesh(fsdp_cfg)
        model = model or self.cfg.model
        ckpt = trainable and model.enable_gradient_checkpointing
        actor = self.cfg.actor
        wrap = with_adapters(
            functools.partial(
                PolicyLM,
                chunk_size=actor.logprob_chunk_size,
                head_impl=actor.logprob_head or "checkpoint",
                compiled_head=bool(model.use_torch_compile),
                sequence_parallel=self.sp,
            ),
            actor.lora if adapters else None,
        )
        module = build_fsdp_model(
            model,
            "causal_lm",
            wrap,
            mesh,
            fsdp_cfg,
            self.device,
            trainable=trainable,
            gradient_checkpointing=ckpt,
            seed=self.cfg.seed,
            varlen_attention=packed,
        )
        info = {
            **mesh_info(mesh, module),
            "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "gradient_checkpointing": bool(module.hf_model.is_gradient_checkpointing),
            "param_offload": fsdp_cfg.param_offload,
            "attn_implementation": module.hf_model.config._attn_implementation,
            "sequence_parallel": self.sp.describe(module.hf_model.config),
        }
        return module, info

    def _build_rollout(self) -> dict[str, Any]:
        """The engine of ``rollout.engine`` and its sharding manager, the engine put to sleep (GPU)
        until the first rollout. The worker keeps one data shard per rank (see the module docstring)."""
        from transformers import AutoTokenizer

        from ppoflow.workers.rollout import build_rollout, build_sharding_manager
        from ppoflow.workers.rollout.sharding_manager import engine_sleep_level

        model = self.cfg.model
        assert self.actor is not None  # init_model builds the policy first
        self.tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer, trust_remote_code=model.trust_remote_code
        )
        self.rollout = build_rollout(
            self.cfg,
            model_path=model.path,
            tokenizer=self.tokenizer,
            actor_module=self.actor.module,
            device=str(self.device),
            rank=self.rank,
            world_size=self.world_size,
        )
        rcfg = self.cfg.rollout
        sleep_level = engine_sleep_level(rcfg.sleep_level, self.is_actor, self._adapter_sync)
        lora = self.cfg.actor.lora
        self.sharding_manager = build_sharding_manager(
            self.rollout,
            self.actor.module,
            loader=rcfg.weight_loader,
            sleep_level=sleep_level,
            quiet=self.checkpoints.paused,
            verify=self.cfg.checkpoint.verify,
            **(dict(lora_sync=lora.sync, base_model=model.path) if lora.enabled else {}),
        )
        info: dict[str, Any] = {"engine": type(self.rollout).__name__}
        describe = getattr(self.rollout, "describe", None)
        if describe is not None:
            info.update(describe(), sleep_level=sleep_level)
            pool = engine_pool_bytes()
            info.update(
                {f"engine_{tag}_gib": round(n / GIB, 3) for tag, n in pool.items() if tag != "asleep"}
            )
        if self.rollout.spec.can("sleep"):
            self.sharding_manager.sleep()
        return info

    @property
    def _adapter_sync(self) -> bool:
        """Whether the engine serves the policy's LoRA adapter (``actor.lora.sync: adapter`` with an
        engine that has the ``adapter_sync`` capability)."""
        lora = self.cfg.actor.lora
        return lora.enabled and lora.sync == "adapter" and self.rollout.spec.can("adapter_sync")

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Build what the role needs: the actor (FSDP module, AdamW, LR schedule), the rollout
        engine, the frozen reference and teacher. Returns a JSON summary of this rank's layout. Every rank's
        torch, Python and numpy RNGs are seeded first (they go into checkpoints)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        seed_rngs(cfg.seed)
        info: dict[str, Any] = {"rank": self.rank, "role": self.role}
        self._set_layout()
        common: dict[str, Any] = dict(rollout_n=cfg.rollout.n, dp_size=self.dp_size, device=self.device)
        common.update(default_temperature=cfg.rollout.temperature, seed=cfg.seed)
        ref_packed = cfg.ref.log_prob_use_dynamic_bsz
        ref_packed = cfg.actor.use_dynamic_bsz if ref_packed is None else ref_packed
        if self.is_actor or self.is_rollout:
            module, info["actor"] = self._build_policy(
                cfg.actor.fsdp, trainable=self.is_actor, packed=cfg.actor.use_dynamic_bsz
            )
            optimizer = scheduler = None
            if self.is_actor:
                optimizer, scheduler = build_optimizer(module, cfg.actor.optim)
                info["actor"]["optimizer"] = optimizer_kernel(optimizer)
            rejected = cfg.algorithm.rollout_correction.mis_normaliser
            self.actor = DataParallelPPOActor(
                cfg.actor, module, optimizer, scheduler, **common, rejected=rejected
            )
        self._ref_is_base = False  # the reference is the actor's module with its adapters off
        if self.is_ref:
            if cfg.actor.lora.enabled and self.actor is not None:
                module, info["ref"] = self.actor.module, {"shared_with": "actor", "adapters": "off"}  # type: ignore[assignment]  # the actor's PolicyLM
                ref_packed = ref_packed and cfg.actor.use_dynamic_bsz  # the actor's attention
                self._ref_is_base = True
            else:  # its own copy (with LoRA on and no actor in this role: the plain base model)
                module, info["ref"] = self._build_policy(
                    cfg.ref.fsdp, trainable=False, packed=ref_packed, adapters=False
                )
            self.ref = DataParallelPPOActor(
                cfg.actor,
                module,
                **common,
                log_prob_micro_batch_size=cfg.ref.log_prob_micro_batch_size_per_gpu,
                log_prob_use_dynamic_bsz=ref_packed,
                log_prob_max_token_len=cfg.ref.log_prob_max_token_len_per_gpu,
                log_prob_section="ref",
            )
        self._build_teacher(info, common)
        if self.is_rollout:
            with preserved_rngs():  # the engine reseeds them: a group with one starts as one without
                info["rollout"] = self._build_rollout()
        info["init_s"] = round(time.perf_counter() - t0, 3)
        return info

    def _set_layout(self) -> None:
        """The sequence-parallel layout of the actor (or the reference alone) and the data layout
        it implies (see the module docstring); ValueError when the actor and the reference of
        this worker ask for different sizes (the worker has one data layout)."""
        actor_sp = self.cfg.actor.sequence_parallel_size
        ref_sp = self.cfg.ref.sequence_parallel_size or actor_sp
        if self.is_ref and (self.is_actor or self.is_rollout) and ref_sp != actor_sp:
            raise ValueError(
                f"ref.sequence_parallel_size={ref_sp} differs from actor.sequence_parallel_size="
                f"{actor_sp}, but role {self.role!r} holds both on the same ranks: set them equal "
                "(or leave ref.sequence_parallel_size unset)"
            )
        size, section = (actor_sp, "actor") if self.is_actor or self.is_rollout else (ref_sp, "ref")
        self.sp = SequenceParallel.build(size, self.device.type, section)
        self.dp_rank, self.dp_size = self.sp.dp_rank, self.sp.dp_size
        self.is_output_rank = self.sp.rank == 0

    def _generate(self, rollout: Any, prompts: DataProto) -> DataProto:
        """The engine's rollout of ``prompts``; sequence parallel: this rank samples its 1/sp of
        the group's prompts and the group gathers the rollouts (every rank holds them all)."""
        if not self.sp.on:
            return rollout.generate_sequences(prompts)
        mine = prompts.chunk(self.sp.size)[self.sp.rank]
        return self.sp.gather_proto(rollout.generate_sequences(mine))

    def _need(self, what: str) -> Any:
        """The actor / ref / rollout, or a clear error naming the role that lacks it."""
        obj = getattr(self, what)
        if obj is None:
            raise RuntimeError(
                f"{what} is not available in role {self.role!r} (or init_model was not called)"
            )
        return obj

    # ------------------------------------------------------------------ compute
    @register(Dispatch.DP_COMPUTE_PROTO, metrics=EPISODE_METRIC_RULES)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``rollout.n`` responses per prompt, then recompute ``old_log_probs`` (B*n, R) with
        the FSDP actor: the PPO ratio's denominator comes from the trained model. With
        ``algorithm.rollout_correction.behaviour: sampler`` the engine's ``rollout_log_probs`` are
        the ``old_log_probs`` instead, and the recompute is skipped."""
        rollout = self._need("rollout")
        manager = self.sharding_manager
        with manager:  # pushes the actor's weights into the engine if they changed
            with PeakMemory(self.device) as gen_mem:
                out = self._generate(rollout, prompts)
            pool = engine_pool_bytes()
        out.meta_info.setdefault("temperature", self.cfg.rollout.temperature)
        metrics = out.meta_info.setdefault("metrics", {})
        metrics["rollout/weight_sync_s"] = manager.last_sync_s
        for key, seconds in getattr(manager, "last_timing", {}).items():
            metrics[f"rollout/{key}"] = seconds
        t0 = time.perf_counter()
        with PeakMemory(self.device) as lp_mem:
            if self.cfg.algorithm.rollout_correction.behaviour == "sampler":  # bypass: no recompute
                log_probs = out.batch["rollout_log_probs"].float().clone()
            else:
                log_probs, _ = self._need("actor").compute_log_prob(out)
        metrics["perf/old_log_prob_s"] = time.perf_counter() - t0
        if gen_mem.on:
            metrics["perf/mem/generate_gib"] = gen_mem.gib
            metrics["perf/mem/old_log_prob_gib"] = lp_mem.gib
            for tag in ("weights", "kv_cache"):
                if tag in pool:
                    metrics[f"perf/mem/engine_{tag}_gib"] = pool[tag] / GIB
        out.batch["old_log_probs"] = log_probs
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, metrics=EPISODE_METRIC_RULES)
    def generate_responses(self, prompts: DataProto) -> DataProto:
        """Responses only, no old log-probs (evaluation): the engine's output with the sampling
        settings of ``prompts.meta_info`` (``do_sample=False``: greedy), after the same weight push
        as :meth:`generate_sequences`."""
        rollout = self._need("rollout")
        manager = self.sharding_manager
        with manager:
            out = self._generate(rollout, prompts)
        out.meta_info.setdefault("metrics", {})["rollout/weight_sync_s"] = manager.last_sync_s
        return out

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False) -> DataProto:
        """``old_log_probs`` (B, R) (+ ``entropys`` (B, R)) of ``responses`` under the actor."""
        actor = self._need("actor")
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=calculate_entropy)
        tensors = {"old_log_probs": log_probs}
        if entropy is not None:
            tensors["entropys"] = entropy
        return DataProto.from_dict(tensors, meta_info={"temperature": actor._temperature(data)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, R) of ``responses`` under the frozen reference policy (with LoRA: the
        actor's module with its adapters switched off)."""
        ref = self._need("ref")
        with adapters_off(ref.module) if self._ref_is_base else contextlib.nullcontext():
            log_probs, _ = ref.compute_log_prob(data)
        return DataProto.from_dict({"ref_log_prob": log_probs})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO update of the actor on this rank's share; returns the (globally reduced) metrics."""
        actor = self._need("actor")
        if actor.optimizer is None:
            raise RuntimeError(f"role {self.role!r} has no trainable actor")
        with optimizer_state_on(actor.optimizer, self.cfg.actor.fsdp, self.device):
            t0 = time.perf_counter()
            with PeakMemory(self.device) as mem, deterministic_updates(self.cfg.resources.deterministic):
                metrics = actor.update_policy(data)
            metrics["perf/update_actor_s"] = time.perf_counter() - t0
            if mem.on:
                metrics["perf/mem/update_actor_gib"] = mem.gib
                metrics["perf/mem/actor_group_resident_gib"] = resident_gib(self.device)
            if self.sharding_manager is not None:
                self.sharding_manager.set_source_live()  # the next rollout streams the new weights
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def _trained(self) -> DataParallelPPOActor:
        return self._need("actor")

    @register(Dispatch.ONE_TO_ALL)
    def load_policy(self, url: str) -> None:
        """Sample from the weights of checkpoint ``url`` (a published policy version, weights only)
        from the next rollout on: an engine with ``weight_push`` loads them on its next entry; an
        engine that samples with the policy module itself (HF) gets them loaded into it now."""
        rollout = self._need("rollout")
        if rollout.spec.can("weight_push"):
            self.sharding_manager.set_source_checkpoint(url)
        else:
            self.load_checkpoint(url, with_optimizer=False)

    def _checkpoint_loaded(self, url: str) -> None:
        if self.sharding_manager is not None:
            self.sharding_manager.set_source_checkpoint(url)  # the next rollout loads these weights

    def shutdown(self) -> None:
        """Finish a checkpoint write in flight, then drop the engines, modules and optimizer state
        before the process group goes away."""
        self.checkpoints.close()
        if hasattr(self.sharding_manager, "close"):
            self.sharding_manager.close()  # a LoRA manager's adapter directories
        if self.rollout is not None and hasattr(self.rollout, "shutdown"):
            self.rollout.shutdown()
        self.rollout = self.sharding_manager = self.actor = self.ref = self.teacher = None
        self._meshes.clear()
        gc.collect()
