"""CriticWorker: the value model of PPO on the ranks of one group.

Config: ``{"config": ExperimentConfig as JSON dict (or string)}``. The critic is a one-label
token-classification model (no head dropout) loaded from ``critic.model``, or from the actor's
base model (a causal LM checkpoint: the ``score`` head then starts from ``cfg.seed``).

The driver calls the ``@register`` methods as ``CriticContract`` says
(``ppoflow.infra.remote.contracts``; ``init_model``, ``compute_values`` -> "values" (B, R),
``update_critic`` -> metrics, and the checkpoint methods).

``critic.sequence_parallel_size`` = sp > 1: groups of sp consecutive ranks get the same rows and
split each packed micro-batch's tokens (``ppoflow.workers.sequence_parallel``); ``init_model``
sets ``dp_rank``/``dp_size`` and the output ranks accordingly.
"""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.contracts import CRITIC_ROLE
from ppoflow.infra.remote.rank.seeding import seed_rngs
from ppoflow.infra.remote.rank.worker import Dispatch, Worker, register
from ppoflow.workers.checkpointing import CheckpointMethods
from ppoflow.workers.critic import DataParallelPPOCritic
from ppoflow.workers.determinism import deterministic_updates
from ppoflow.workers.device_memory import PeakMemory, release_cached, resident_gib
from ppoflow.workers.fsdp_utils import build_fsdp_model, build_mesh, mesh_info
from ppoflow.workers.lora import with_adapters
from ppoflow.workers.modeling import ValueModel
from ppoflow.workers.optim import build_optimizer, optimizer_kernel, optimizer_state_on
from ppoflow.workers.sequence_parallel import SequenceParallel
from ppoflow.workers.worker_setup import parse_worker_config

__all__ = ["CriticWorker"]


class CriticWorker(CheckpointMethods, Worker):
    """FSDP critic + AdamW; values and clipped value-loss updates."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.cfg, self.role = parse_worker_config(config, CRITIC_ROLE.modes, CRITIC_ROLE.default.wire)
        self.critic: DataParallelPPOCritic | None = None
        self._init_checkpoints()

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the value model on every rank (same seed), shard it, build AdamW + LR schedule.
        Every rank's torch, Python and numpy RNGs are seeded first (``seed_rngs``)."""
        t0 = time.perf_counter()
        cfg = self.cfg
        seed_rngs(cfg.seed)
        model_cfg = cfg.critic_model
        sp = SequenceParallel.build(cfg.critic.sequence_parallel_size, self.device.type, "critic")
        self.dp_rank, self.dp_size, self.is_output_rank = sp.dp_rank, sp.dp_size, sp.rank == 0
        mesh = build_mesh(cfg.critic.fsdp, self.world_size, self.device.type)
        module = build_fsdp_model(
            model_cfg,
            "token_classification",
            with_adapters(
                functools.partial(ValueModel, sequence_parallel=sp), cfg.critic.lora
            ),  # LoRA: adapters + the value head trained
            mesh,
            cfg.critic.fsdp,
            self.device,
            gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
            seed=cfg.seed,
            varlen_attention=cfg.critic.packed,
        )
        hf = module.hf_model
        optimizer, scheduler = build_optimizer(module, cfg.critic.optim)
        self.critic = DataParallelPPOCritic(
            cfg.critic,
            module,
            optimizer,
            scheduler,
            rollout_n=cfg.rollout.n,
            dp_size=self.dp_size,
            device=self.device,
            seed=cfg.seed,
        )
        info = {
            **mesh_info(mesh, module),
            "gradient_checkpointing": bool(hf.is_gradient_checkpointing),
            "param_offload": cfg.critic.fsdp.param_offload,
            "optimizer": optimizer_kernel(optimizer),
            "sequence_parallel": sp.describe(hf.config),
        }
        return {
            "rank": self.rank,
            "role": "critic",
            "critic": info,
            "init_s": round(time.perf_counter() - t0, 3),
        }

    def _need(self) -> DataParallelPPOCritic:
        if self.critic is None:
            raise RuntimeError("init_model was not called")
        return self.critic

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, R): ``V(s_t)`` before each response token, 0 off the response mask."""
        return DataProto.from_dict({"values": self._need().compute_values(data)})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value-loss update on this rank's share; returns the (globally reduced) metrics."""
        critic = self._need()
        assert critic.optimizer is not None  # init_model built it with one
        with optimizer_state_on(critic.optimizer, self.cfg.critic.fsdp, self.device):
            t0 = time.perf_counter()
            with PeakMemory(self.device) as mem, deterministic_updates(self.cfg.resources.deterministic):
                metrics = critic.update_critic(data)
            metrics["perf/update_critic_s"] = time.perf_counter() - t0
        if mem.on:  # the rollout engine of the next iteration maps its memory on this GPU
            metrics["perf/mem/update_critic_gib"] = mem.gib
            metrics["perf/mem/critic_group_resident_gib"] = resident_gib(self.device)
            release_cached(self.device)
        return metrics

    def _trained(self) -> DataParallelPPOCritic:
        return self._need()

    def shutdown(self) -> None:
        """Finish a checkpoint write in flight, then drop the module and optimizer before the
        process group goes away."""
        self.checkpoints.close()
        self.critic = None
        gc.collect()
