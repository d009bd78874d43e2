"""DataParallelPPOActor: log-probs and PPO updates of an FSDP-sharded policy (``PolicyLM``).

One instance per rank; every rank holds an equal share of the batch (the driver splits it).

    actor = DataParallelPPOActor(cfg.actor, module, optimizer, scheduler, rollout_n=cfg.rollout.n,
                                 dp_size=world_size, device=device)
    log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)   # (B, R) each
    metrics = actor.update_policy(data)                                         # {"actor/pg_loss": ...}

Gradient accumulation is exact: each micro-batch's loss is weighted by its share of the whole
mini-batch *across all data-parallel ranks* (tokens for ``token-mean``, sequences with at least one
response token for the ``seq-mean-*`` modes), so one optimizer step equals one step on the whole
mini-batch in a single process, whatever the micro-batch size, rank count or padding lengths.

With ``use_dynamic_bsz`` a micro-batch is not a fixed number of rows but as many rows as fit
``ppo_max_token_len_per_gpu`` real tokens (``log_prob_max_token_len_per_gpu`` for log-probs), and it
runs packed: the padding is dropped before the model (``ppoflow.workers.packing``). The weighting
above does not depend on how rows are split, so the update is the same step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ppoflow.algos import agg_loss, compute_policy_loss, kl_penalty
from ppoflow.workers.fsdp_utils import reshard_all
from ppoflow.workers.optim import finish_mini_batch, global_sum
from ppoflow.workers.packing import token_budget_micro_batches

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import ActorConfig
    from ppoflow.infra.data.dataproto import DataProto

__all__ = [
    "DataParallelPPOActor",
    "agg_count",
    "row_slices",
    "response_mask_of",
    "to_device",
    "mini_batch_rows",
    "shuffle_seed",
    "summarize_steps",
    "world_size",
    "mini_batch_rows_per_rank",
    "micro_batches",
]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def world_size() -> int:
    """Ranks of the default process group (1 without torch.distributed): FSDP averages gradients
    over all of them, so a rank's loss is scaled by it to turn the average back into a sum."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mini_batch_rows_per_rank(mini_batch_size: int, rollout_n: int, dp_size: int, section: str) -> int:
    """``mini_batch_size * rollout_n / dp_size``; ValueError naming the config if it does not divide."""
    rows = mini_batch_size * rollout_n
    if rows % dp_size:
        raise ValueError(
            f"{section}.ppo_mini_batch_size * rollout.n = {rows} rows must be divisible by the "
            f"data-parallel size {dp_size}"
        )
    return rows // dp_size


def response_mask_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, R) response mask: the ``response_mask`` column, else the response part of ``attention_mask``."""
    if "response_mask" in batch:
        return batch["response_mask"]
    resp_len = batch["responses"].shape[1]
    return batch["attention_mask"][:, -resp_len:]


def agg_count(mask: torch.Tensor, loss_agg_mode: str) -> float:
    """What ``agg_loss`` averages over, for a (B, R) mask: valid tokens (``token-mean``) or
    sequences with at least one valid token (``seq-mean-*``)."""
    if loss_agg_mode == "token-mean":
        return float((mask != 0).sum())
    return float((mask != 0).any(dim=-1).sum())


def row_slices(n: int, size: int) -> list[slice]:
    """Consecutive row ranges of at most ``size`` rows covering ``range(n)``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, max(1, size))]


def to_device(batch: dict[str, torch.Tensor], rows: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows ``rows`` (slice or index tensor) of every column, moved to ``device``."""
    return {k: v[rows].to(device, non_blocking=True) for k, v in batch.items()}


def mini_batch_rows(n: int, size: int, epochs: int, shuffle: bool, seed: int) -> Iterator[torch.Tensor]:
    """Row indices of each mini-batch, epoch after epoch (with ``shuffle`` a permutation per epoch,
    drawn from its own generator seeded with ``seed``: the global RNG is left alone)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.arange(n)
        if shuffle:
            order = torch.randperm(n, generator=gen)
        for sl in row_slices(n, size):
            yield order[sl]


def shuffle_seed(seed: int, data: DataProto, calls: int) -> int:
    """The mini-batch shuffle's seed for one update: from the run's seed and the iteration the
    batch belongs to (``meta_info["iteration"]``, set by ``generate``), so an update recomputed
    after a failure or in a resumed run shuffles as the first one did; ``calls`` (this worker's
    update count) only for batches that name no iteration."""
    return seed * 1_000_003 + int(data.meta_info.get("iteration", calls))


def micro_batches(
    rows: torch.Tensor,
    attention_mask: torch.Tensor,
    size: int,
    max_tokens: int | None,
    device: torch.device,
    field: str,
) -> list[torch.Tensor]:
    """Split ``rows`` (indices into the batch) into micro-batches: consecutive runs of ``size`` rows,
    or with ``max_tokens`` groups of at most that many real tokens (``attention_mask`` counts),
    the same number of groups on every rank (a collective then). ``field`` names the budget's
    config field in errors."""
    if max_tokens is None:
        return [rows[sl] for sl in row_slices(len(rows), size)]
    lengths = attention_mask[rows].sum(-1)
    return [rows[idx] for idx in token_budget_micro_batches(lengths, max_tokens, device, field)]


class DataParallelPPOActor:
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
    """

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
    ):
        self.config, self.module = config, module
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.device = torch.device(device)
        self.dp_size, self.seed, self.updates = dp_size, seed, 0
        self.default_temperature = default_temperature
        self.log_prob_micro_batch_size = log_prob_micro_batch_size or config.log_prob_micro_batch_size_per_gpu
        self.rollout_n = rollout_n
        self.grad_scale = world_size()
        self.packed = bool(config.use_dynamic_bsz)
        self.log_prob_packed = self.packed if log_prob_use_dynamic_bsz is None else log_prob_use_dynamic_bsz
        self.log_prob_max_tokens = (
            log_prob_max_token_len
            or config.log_prob_max_token_len_per_gpu
            or config.ppo_max_token_len_per_gpu
        )
        self.log_prob_section = log_prob_section

    @property
    def mini_batch_size(self) -> int:
        """Rows of one mini-batch on this rank: ``ppo_mini_batch_size * rollout_n / dp_size``."""
        return mini_batch_rows_per_rank(
            self.config.ppo_mini_batch_size, self.rollout_n, self.dp_size, "actor"
        )

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
        self.module.eval()
        temperature = self._temperature(data)
        keys = [k for k in (*MODEL_INPUTS, "response_mask") if k in data.batch]
        batch = {k: data.batch[k] for k in keys}
        shape = batch["responses"].shape
        log_probs = torch.zeros(shape, dtype=torch.float32)
        entropy = torch.zeros(shape, dtype=torch.float32) if calculate_entropy else None
        groups = micro_batches(
            torch.arange(len(data)),
            batch["attention_mask"],
            self.log_prob_micro_batch_size,
            self.log_prob_max_tokens if self.log_prob_packed else None,
            self.device,
            f"{self.log_prob_section}.log_prob_max_token_len_per_gpu",
        )
        for rows in groups:
            mb = to_device(batch, rows, self.device)
            out = self._forward(mb, temperature, calculate_entropy, packed=self.log_prob_packed)
            log_probs[rows] = out["log_probs"].float().cpu()
            if entropy is not None:
                entropy[rows] = out["entropy"].float().cpu()
        reshard_all(self.module)
        return log_probs, entropy

    def _micro_losses(
        self, mb: dict[str, torch.Tensor], temperature: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO loss of one micro-batch (as ``agg_loss`` over this micro-batch) and its metrics."""
        cfg = self.config
        mask = response_mask_of(mb)
        out = self._forward(
            mb, temperature, with_entropy=True, entropy_grad=cfg.entropy_coeff != 0, packed=self.packed
        )
        log_prob = out["log_probs"]
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
            mb["old_log_probs"],
            log_prob,
            mb["advantages"],
            mask,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
        )
        entropy = agg_loss(out["entropy"], mask, cfg.loss_agg_mode)
        loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff != 0 else pg_loss
        metrics = {
            "actor/pg_loss": pg_loss.item(),
            "actor/pg_clipfrac": clipfrac.item(),
            "actor/ppo_kl": ppo_kl.item(),
            "actor/pg_clipfrac_lower": clipfrac_lower.item(),
            "actor/entropy": entropy.item(),
        }
        if cfg.use_kl_loss:
            kld = kl_penalty(log_prob, mb["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        return loss, metrics

    def _train_mini_batch(
        self, batch: dict[str, torch.Tensor], rows: torch.Tensor, temperature: float
    ) -> dict[str, float]:
        """Gradient accumulation over the micro-batches of one mini-batch, then one optimizer step."""
        cfg = self.config
        local_count = agg_count(response_mask_of(batch)[rows], cfg.loss_agg_mode)
        (total,) = global_sum([local_count], self.device)
        sums: dict[str, float] = {}
        groups = micro_batches(
            rows,
            batch["attention_mask"],
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.ppo_max_token_len_per_gpu if self.packed else None,
            self.device,
            "actor.ppo_max_token_len_per_gpu",
        )
        for mb_rows in groups:
            mb = to_device(batch, mb_rows, self.device)
            loss, metrics = self._micro_losses(mb, temperature)
            weight = agg_count(response_mask_of(mb), cfg.loss_agg_mode) / total if total > 0 else 0.0
            (loss * (weight * self.grad_scale)).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + weight * value
        out = finish_mini_batch(
            self.module, self.optimizer, self.lr_scheduler, cfg.optim.grad_clip, sums, self.device, "actor"
        )
        return {**out, "actor/micro_batches": float(len(groups))}

    def update_policy(self, data) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches (gradient accumulation), one optimizer step per
        mini-batch; a step whose gradient norm is not finite is skipped (``actor/skipped_steps``).

        Args:
            data: DataProto with the model inputs, ``old_log_probs``, ``advantages`` (B, R),
                ``response_mask`` (optional) and ``ref_log_prob`` (with ``use_kl_loss``).

        Returns:
            metrics averaged over the optimizer steps (identical on every rank): ``actor/pg_loss``,
            ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``, ``actor/entropy``,
            ``actor/kl_loss`` (with ``use_kl_loss``), ``actor/grad_norm``, ``actor/lr`` (the LR of
            the last step), ``actor/skipped_steps`` (a sum), ``actor/optimizer_steps`` and
            ``actor/micro_batches`` (per optimizer step, the same on every rank).
        """
        if self.optimizer is None:
            raise RuntimeError("this actor has no optimizer (a reference policy cannot be updated)")
        cfg = self.config
        keys = [*MODEL_INPUTS, "old_log_probs", "advantages"]
        keys += [k for k in ("response_mask",) if k in data.batch]
        keys += ["ref_log_prob"] if cfg.use_kl_loss else []
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(f"update_policy needs columns {missing} (have {sorted(data.batch)})")
        batch = {k: data.batch[k] for k in keys}
        temperature = self._temperature(data)
        self.module.train()
        steps: list[dict[str, float]] = []
        self.updates += 1
        seed = shuffle_seed(self.seed, data, self.updates)
        for rows in mini_batch_rows(len(data), self.mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed):
            steps.append(self._train_mini_batch(batch, rows, temperature))
        self.module.eval()
        return summarize_steps(steps, "actor")


def summarize_steps(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Mean of each metric over the optimizer steps; ``*/lr`` is the last value, ``*/skipped_steps``
    a sum; adds ``<prefix>/optimizer_steps``."""
    out: dict[str, float] = {}
    for key in steps[0] if steps else []:
        values = [s[key] for s in steps]
        if key.endswith("/lr"):
            out[key] = values[-1]
        elif key.endswith("/skipped_steps"):
            out[key] = sum(values)
        else:
            finite = [v for v in values if math.isfinite(v)]
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    out[f"{prefix}/optimizer_steps"] = float(len(steps))
    return out
