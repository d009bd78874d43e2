"""The worker of the model matrix's scenario (tests/support/models/matrix_scenario.py): ppoflow's own
``ActorRolloutRefWorker`` (role ``actor_rollout``: the FSDP actor and the vLLM engine in every
rank), plus what the scenario checks that no production method returns.

    init_model()                  the production build; with ``lora`` in the group config, first a
                                  second policy with LoRA adapters on the same base (and its merged
                                  push into the same engine)
    packing_check(seed)           ONE_TO_ALL: the actor's PPO loss, log-probs and gradients of one
                                  micro-batch (the same rows on every rank) padded, packed and, with
                                  ``sp``, packed across a sequence-parallel group of 2 ranks
    lora_update(data)             DP_COMPUTE_PROTO: one PPO update of the LoRA policy
    lora_generate(prompts)        DP_COMPUTE_PROTO: its merged weights pushed, a rollout, its log-probs

Everything else (``generate_sequences``, ``update_actor``, ``save_checkpoint``, ``load_policy``,
``compute_log_prob``) is the production worker's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# Every row's group builds a vLLM engine in both ranks. A CPU group's launcher imports this module
# once and forks the ranks from it (ppoflow.infra.remote.rank.launch): importing vLLM here (the
# import starts no thread) makes that one import a row instead of one a rank (a row measured 7%
# fewer CPU-seconds).
import vllm  # noqa: F401

from ppoflow.infra.remote.rank.worker import Dispatch, register
from ppoflow.workers.actor_rollout_ref_worker import ActorRolloutRefWorker


def _rows(seed: int, vocab: int, prompt: int, response: int) -> dict[str, torch.Tensor]:
    """Four left-padded prompts with right-padded responses, some longer than a sliding window
    (32), one with a 1-token prompt, one with no response; ``old_log_probs`` and ``advantages``
    for the PPO loss. The same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (4, prompt + response), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate([(prompt, response), (1, 3), (30, response), (20, 0)]):
        mask[i, prompt - p : prompt + r] = 1
    responses = ids[:, prompt:]
    return {
        "input_ids": ids * mask,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses * mask[:, prompt:],
        "response_mask": mask[:, prompt:],
        "old_log_probs": -torch.rand(4, response, generator=g) * 6,
        "advantages": torch.randn(4, 1, generator=g).expand(4, response).contiguous(),
    }


class MatrixWorker(ActorRolloutRefWorker):
    """``ActorRolloutRefWorker`` with the checks of the model matrix (module docstring)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.want_lora = bool(config.get("lora"))
        self.want_sp = bool(config.get("sp"))
        self.lora_targets = config.get("lora_targets") or "all-linear"
        self.lora_actor: Any = None
        self.lora_manager: Any = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        lora_module = self._build_lora_policy() if self.want_lora else None  # before the engine starts
        info = super().init_model()
        if lora_module is not None:
            from ppoflow.workers.actor import DataParallelPPOActor
            from ppoflow.workers.optim import build_optimizer
            from ppoflow.workers.rollout.lora_sync import LoRAShardingManager

            cfg = self.cfg
            # adapters start at zero: a larger step than the full model's moves the policy as far
            optimizer, scheduler = build_optimizer(
                lora_module, cfg.actor.optim.model_copy(update={"lr": 0.1})
            )
            self.lora_actor = DataParallelPPOActor(
                cfg.actor, lora_module, optimizer, scheduler, dp_size=self.dp_size, device=self.device
            )
            self.lora_manager = LoRAShardingManager(
                self.rollout, lora_module, sync="merged", base_model=cfg.model.path
            )
            info["lora_trainable"] = sum(p.numel() for p in lora_module.parameters() if p.requires_grad)
        return info

    def _build_lora_policy(self):
        from ppoflow.infra.config import LoRAConfig
        from ppoflow.workers.fsdp_utils import build_fsdp_model
        from ppoflow.workers.lora import with_adapters
        from ppoflow.workers.modeling import PolicyLM

        cfg = self.cfg
        wrap = with_adapters(
            functools.partial(PolicyLM, chunk_size=cfg.actor.logprob_chunk_size),
            LoRAConfig(rank=4, alpha=8.0, target_modules=self.lora_targets),
        )
        return build_fsdp_model(
            cfg.model,
            "causal_lm",
            wrap,
            self._mesh(cfg.actor.fsdp),
            cfg.actor.fsdp,
            self.device,
            varlen_attention=cfg.actor.use_dynamic_bsz,
        )

    @register(Dispatch.ONE_TO_ALL)
    def packing_check(self, seed: int = 0) -> dict[str, Any]:
        """The actor's loss, log-probs and full gradients of one micro-batch, padded against packed
        (and sequence parallel): the largest differences, and the padded figures' scale."""
        from ppoflow.workers.sequence_parallel import SequenceParallel

        actor = self._need("actor")
        config = actor.module.hf_model.config
        batch = _rows(seed, min(config.vocab_size, 200), 48, 24)
        runs = {"padded": self._loss_and_grads(actor, batch, packed=False)}
        if self.cfg.actor.use_dynamic_bsz:
            runs["packed"] = self._loss_and_grads(actor, batch, packed=True)
        if self.want_sp:
            layout, module = SequenceParallel.build(2, self.device.type, "actor"), actor.module
            module.sequence_parallel, actor.sp_size = layout, 2
            try:
                runs["sequence_parallel"] = self._loss_and_grads(actor, batch, packed=True)
            finally:
                module.sequence_parallel, actor.sp_size = self.sp, 1
        base = runs["padded"]
        out: dict[str, Any] = {
            "loss": base["loss"],
            "grad_max": float(base["grads"].abs().max()),
            "moe": {k: v for k, v in base["metrics"].items() if k.startswith("actor/moe/")},
        }
        for name, run in runs.items():
            if name != "padded":
                out[name] = {
                    "loss": abs(run["loss"] - base["loss"]),
                    "log_probs": float((run["log_probs"] - base["log_probs"]).abs().max()),
                    "grads": float((run["grads"] - base["grads"]).abs().max()),
                }
        return out

    def _loss_and_grads(self, actor, batch: dict[str, torch.Tensor], packed: bool) -> dict[str, Any]:
        from ppoflow.workers.fsdp_utils import full_param

        module = actor.module
        actor.packed = packed
        module.train()
        try:
            loss, metrics = actor._micro_losses(batch, 1.0)
            loss.backward()
            with torch.no_grad():
                log_probs = actor._forward(batch, 1.0, with_entropy=False, packed=packed)["log_probs"]
            grads = torch.cat(
                [full_param(p.grad).flatten() for p in module.parameters() if p.grad is not None]
            )
        finally:
            module.zero_grad(set_to_none=True)
            module.eval()
            actor.packed = bool(self.cfg.actor.use_dynamic_bsz)
        return {"loss": float(loss), "metrics": metrics, "log_probs": log_probs.detach(), "grads": grads}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def lora_update(self, data) -> dict[str, float]:
        """One PPO update of the LoRA policy (its next rollout pushes the merged weights); the
        metrics, and ``lora/moved``: how far it moved the log-probs of ``data``'s tokens."""
        before, _ = self.lora_actor.compute_log_prob(data)
        metrics = self.lora_actor.update_policy(data)
        after, _ = self.lora_actor.compute_log_prob(data)
        mask = data.batch["response_mask"].bool()
        metrics["lora/moved"] = float((after - before)[mask].abs().max())
        self.lora_manager.set_source_live()
        return metrics

    @register(Dispatch.DP_COMPUTE_PROTO)
    def lora_generate(self, prompts):
        """A rollout from the LoRA policy's merged weights, with the LoRA policy's log-probs. The
        engine then holds them: the production policy's next rollout must follow ``load_policy``
        (or an update), which makes its manager push again."""
        with self.lora_manager:
            out = self._generate(self.rollout, prompts)
        out.batch["old_log_probs"], _ = self.lora_actor.compute_log_prob(out)
        return out
