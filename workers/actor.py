"""DataParallelPPOActor: log-probs and PPO updates of an FSDP-sharded policy (``PolicyLM``).

One instance per rank; every rank holds an equal share of the batch (the driver splits it).

    actor = DataParallelPPOActor(cfg.actor, module, optimizer, scheduler, rollout_n=cfg.rollout.n,
                                 dp_size=world_size, device=device)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)   # (B, R) each
    metrics = actor.update_policy(data)                                         # {"actor/pg_loss": ...}

The batching, the exact gradient accumulation and the packed micro-batches of ``use_dynamic_bsz``
are the critic's too: ``ppoflow.workers.minibatch``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ppoflow.algos import agg_loss, get_policy_loss, kl_penalty
from ppoflow.workers.minibatch import MODEL_INPUTS, MiniBatchTrainer, response_mask_of
from ppoflow.workers.moe import RouterStats

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import ActorConfig

__all__ = ["DataParallelPPOActor", "IS_WEIGHTS", "RS_MASK"]

IS_WEIGHTS = "rollout_is_weights"  # (B, R) TIS weights of the rollout correction
RS_MASK = "rollout_rs_mask"  # (B, R) 1 on the tokens the rollout correction keeps


def _rejected_dropped(data):
    """``data`` whose response mask leaves out what the rollout correction rejected (its
    ``rollout_rs_mask``; ``mis_normaliser: kept``); ``data`` itself without one. The caller's batch
    is not changed."""
    if RS_MASK not in data.batch:
        return data
    batch = dict(data.batch)
    mask = response_mask_of(batch)
    batch["response_mask"] = mask * data.batch[RS_MASK].to(mask.dtype)
    return type(data).from_dict(batch, meta_info=dict(data.meta_info))


class DataParallelPPOActor(MiniBatchTrainer):
    """PPO log-probs and updates for one rank of an FSDP policy.

    Args:
        config: the ``actor`` section (micro/mini-batch sizes, clip ratios, losses, optimizer).
        module: an FSDP-sharded ``ppoflow.workers.modeling.PolicyLM`` (the root).
        optimizer, lr_scheduler: ``None`` for a reference policy (``update_policy`` then raises).
        rollout_n: responses per prompt (a mini-batch is ``ppo_mini_batch_size * rollout_n`` rows).
        dp_size: number of distinct data shards (the driver's ``dp_size``: the world size, or fewer
            when ranks share a shard, e.g. vLLM tensor parallel). May be changed between calls.
            Losses are weighted by global counts over all ranks, so duplicated shards stay exact.
        device: where micro-batches are computed.
        default_temperature: used when ``data.meta_info`` has no ``temperature``.
        log_prob_micro_batch_size: override of ``config.log_prob_micro_batch_size_per_gpu`` (ref).
        log_prob_use_dynamic_bsz, log_prob_max_token_len: overrides of ``config.use_dynamic_bsz``
            and of the log-prob token budget for ``compute_log_prob`` (ref); ``log_prob_section``
            names their config section in errors.
        rejected: what a token the rollout correction rejected (``rollout_rs_mask`` 0) counts for:
            ``"all"`` (weight 0 in the policy loss, still in its normaliser and in the entropy and
            KL terms) or ``"kept"`` (dropped from the response mask altogether).
    """

    section = "actor"

    def __init__(
        self,
        config: ActorConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        rollout_n: int = 1,
        dp_size: int = 1,
        device: torch.device | str = "cpu",
        default_temperature: float = 1.0,
        log_prob_micro_batch_size: int | None = None,
        log_prob_use_dynamic_bsz: bool | None = None,
        log_prob_max_token_len: int | None = None,
        log_prob_section: str = "actor",
        seed: int = 0,
        rejected: Literal["all", "kept"] = "all",
    ):
        super().__init__(
            config,
            module,
            optimizer,
            lr_scheduler,
            rollout_n=rollout_n,
            dp_size=dp_size,
            device=device,
            seed=seed,
        )
        self.default_temperature = default_temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size or config.log_prob_micro_batch_size_per_gpu
        self.log_prob_packed = self.packed if log_prob_use_dynamic_bsz is None else log_prob_use_dynamic_bsz
        self.log_prob_max_tokens = log_prob_max_token_len or config.log_prob_tokens
        self.log_prob_section = log_prob_section
        self.rejected = rejected
        self.router = RouterStats.of(module)  # a mixture-of-experts policy's routers (None: dense)

    def _temperature(self, data) -> float:
        """Sampling temperature of the rollout (``meta_info["temperature"]``, else the default)."""
        return float(data.meta_info.get("temperature", self.default_temperature))

    def _forward(
        self,
        mb: dict[str, torch.Tensor],
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool = False,
        packed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Module forward on one micro-batch: (b, R) log-probs (+ entropy), zero off the response mask."""
        return self.module(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            responses=mb["responses"],
            response_mask=response_mask_of(mb),
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            packed=packed,
        )

    @torch.no_grad()
    def compute_log_prob(
        self, data, calculate_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``responses`` under the current policy, micro-batch by micro-batch.

        Args:
            data: DataProto with ``input_ids``, ``attention_mask``, ``position_ids`` (B, P+R),
                ``responses`` (B, R) (and optionally ``response_mask``); ``meta_info["temperature"]``.

        Returns:
            ``(log_probs (B, R), entropy (B, R) or None)``, float32 on the CPU; 0 where the
            response mask is 0.
        """
        temperature = self._temperature(data)
        shape = data.batch["responses"].shape
        log_probs = torch.zeros(shape, dtype=torch.float32)
        entropy = torch.zeros(shape, dtype=torch.float32) if calculate_entropy else None
        for rows, mb in self._forward_batches(
            data,
            self.log_prob_micro_batch_size,
            self.log_prob_max_tokens if self.log_prob_packed else None,
            f"{self.log_prob_section}.log_prob_max_token_len_per_gpu",
        ):
            out = self._forward(mb, temperature, calculate_entropy, packed=self.log_prob_packed)
            log_probs[rows] = out["log_probs"].float().cpu()
            if entropy is not None:
                entropy[rows] = out["entropy"].float().cpu()
        return log_probs, entropy

    def _micro_losses(
        self, mb: dict[str, torch.Tensor], temperature: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss (``actor.policy_loss``) of one micro-batch (as ``agg_loss`` over this micro-batch) and its metrics."""
        cfg = self.config
        mask = response_mask_of(mb)
        router: contextlib.AbstractContextManager[list] = (
            self.router.record() if self.router is not None else contextlib.nullcontext([])
        )
        with router as router_logits:
            out = self._forward(
                mb, temperature, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0, packed=self.packed
            )
        log_prob = out["log_probs"]
        weights = mb.get(IS_WEIGHTS)  # the rollout correction's TIS weights, when it has them
        if RS_MASK in mb:  # mis_normaliser all: a rejected token weighs 0 and stays in the normaliser
            kept = mb[RS_MASK].to(log_prob.dtype)
            weights = kept if weights is None else weights * kept
        pg_loss, pg_metrics = get_policy_loss(cfg.policy_loss)(
            mb["old_log_probs"],
            log_prob,
            mb["advantages"],
            mask,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            **({IS_WEIGHTS: weights} if weights is not None else {}),
        )
        entropy = agg_loss(out["entropy"], mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff != 0 else pg_loss
        metrics = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item()}
        if self.router is not None:  # actor/moe/*: the routers' load of this micro-batch's real tokens
            metrics.update(self.router.metrics(router_logits, None if self.packed else mb["attention_mask"]))
        metrics.update({f"actor/{k}": float(v) for k, v in pg_metrics.items()})
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        if cfg.teacher_kl_coef > 0:  # on-policy distillation as a loss term: KL(policy || teacher)
            kld = kl_penalty(log_prob, mb["teacher_log_prob"], cfg.teacher_kl_type)
            teacher_loss = agg_loss(kld, mask, cfg.loss_agg_mode)
            loss = loss + cfg.teacher_kl_coef * teacher_loss
            metrics["actor/teacher_kl_loss"] = teacher_loss.item()
        return loss, metrics

    def _contributing(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> float:
        """The response tokens of ``rows`` that can move the loss: with ``rejected="all"`` and no
        entropy or KL term, those the rollout correction did not reject (a rejected token weighs 0);
        otherwise every masked-in token (with ``kept`` the rejected ones are already out of it)."""
        mask = response_mask_of(batch)[rows] != 0
        cfg = self.config
        if RS_MASK in batch and cfg.entropy_coeff == 0 and not cfg.use_kl_loss and not cfg.teacher_kl_coef:
            mask = mask & (batch[RS_MASK][rows] != 0)
        return float(mask.sum())

    def update_policy(self, data) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches (gradient accumulation), one optimizer step per
        mini-batch; a step whose gradient norm is not finite is skipped (``actor/skipped_steps``).

        Args:
            data: DataProto with the model inputs, ``old_log_probs``, ``advantages`` (B, R),
                ``response_mask`` (optional), ``ref_log_prob`` (with ``use_kl_loss``) and
                ``teacher_log_prob`` (with ``teacher_kl_coef``); from the
                rollout correction (``ppoflow.algos.correction``), optionally ``rollout_is_weights``
                (B, R) (each token's policy loss is multiplied by its weight before aggregation)
                and ``rollout_rs_mask`` (B, R) (the tokens it rejected weigh 0 in the policy loss
                and still count in its normalisation, as in IcePop's objective; with
                ``rejected="kept"`` they are dropped from the response mask instead: no policy,
                entropy or KL loss, and not counted in the normalisation). A mini-batch in which
                no token can move the loss takes no optimizer step (``actor/skipped_steps``).

        Returns:
            metrics averaged over the optimizer steps (identical on every rank): ``actor/pg_loss``,
            ``actor/entropy`` and the policy loss's metrics (``actor/pg_clipfrac``,
            ``actor/pg_clipfrac_low``, ``actor/pg_clipfrac_high``, ``actor/ppo_kl``; ``vanilla``:
            ``actor/pg_clipfrac_lower`` (dual clip); ``gspo*``: ``actor/seq_ratio/mean|min|max``),
            ``actor/kl_loss`` (with ``use_kl_loss``), ``actor/teacher_kl_loss`` (with
            ``teacher_kl_coef``), ``actor/grad_norm``, ``actor/lr`` (the LR of
            the last step), ``actor/skipped_steps`` (a sum), ``actor/optimizer_steps`` and
            ``actor/micro_batches`` (per optimizer step, the same on every rank); a
            mixture-of-experts policy adds ``actor/moe/*`` (``ppoflow.workers.moe``).
        """
        if self.optimizer is None:
            raise RuntimeError("this actor has no optimizer (a reference policy cannot be updated)")
        if self.rejected == "kept":
            data = _rejected_dropped(data)
        keys = [*MODEL_INPUTS, "old_log_probs", "advantages"]
        carried = ("response_mask", IS_WEIGHTS) + ((RS_MASK,) if self.rejected == "all" else ())
        keys += [k for k in carried if k in data.batch]
        keys += ["ref_log_prob"] if self.config.use_kl_loss else []
        keys += ["teacher_log_prob"] if self.config.teacher_kl_coef > 0 else []
        temperature = self._temperature(data)
        return self._update(data, keys, "update_policy", lambda mb: self._micro_losses(mb, temperature))
