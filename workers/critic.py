"""DataParallelPPOCritic: values and clipped value-loss updates of an FSDP-sharded critic
(``ppoflow.workers.modeling.ValueModel``). Same batching and exact gradient accumulation as the actor.

    critic = DataParallelPPOCritic(cfg.critic, module, optimizer, scheduler,
                                   rollout_n=cfg.rollout.n, dp_size=world_size, device=device)
    values = critic.compute_values(data)        # (B, R): values[:, t] = V(s_t), 0 off the mask
    metrics = critic.update_critic(data)        # {"critic/vf_loss": ...}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ppoflow.algos import compute_value_loss, masked_mean
from ppoflow.workers.actor import (
    agg_count,
    micro_batches,
    mini_batch_rows,
    mini_batch_rows_per_rank,
    response_mask_of,
    shuffle_seed,
    summarize_steps,
    to_device,
    world_size,
)
from ppoflow.workers.fsdp_utils import reshard_all
from ppoflow.workers.optim import finish_mini_batch, global_sum

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import CriticConfig

__all__ = ["DataParallelPPOCritic"]

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


class DataParallelPPOCritic:
    """PPO value estimates and updates for one rank of an FSDP critic.

    Args:
        config: the ``critic`` section.
        module: an FSDP-sharded ``ValueModel`` (the root).
        rollout_n: responses per prompt (a mini-batch is ``ppo_mini_batch_size * rollout_n`` rows).
        dp_size: data-parallel ranks sharing a mini-batch.
    """

    def __init__(
        self,
        config: CriticConfig,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        *,
        rollout_n: int = 1,
        dp_size: int = 1,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        self.config, self.module = config, module
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.device, self.dp_size, self.seed, self.updates = torch.device(device), dp_size, seed, 0
        self.rollout_n, self.grad_scale = rollout_n, world_size()
        self.packed = bool(config.use_dynamic_bsz)
        self.forward_max_tokens = config.forward_max_token_len_per_gpu or config.ppo_max_token_len_per_gpu

    @property
    def mini_batch_size(self) -> int:
        """Rows of one mini-batch on this rank: ``ppo_mini_batch_size * rollout_n / dp_size``."""
        return mini_batch_rows_per_rank(
            self.config.ppo_mini_batch_size, self.rollout_n, self.dp_size, "critic"
        )

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """(b, R) float32 values of one micro-batch (packed with ``use_dynamic_bsz``: 0 off the mask)."""
        return self.module(
            input_ids=mb["input_ids"],
            attention_mask=mb["attention_mask"],
            position_ids=mb["position_ids"],
            response_length=mb["responses"].shape[1],
            response_mask=response_mask_of(mb) if self.packed else None,
            packed=self.packed,
        )

    @torch.no_grad()
    def compute_values(self, data) -> torch.Tensor:
        """Values on the response positions, ``forward_micro_batch_size_per_gpu`` rows at a time
        (with ``use_dynamic_bsz``: packed micro-batches of ``forward_max_token_len_per_gpu`` tokens).

        Returns:
            (B, R) float32 on the CPU: ``values[:, t] = V(s_t)`` before response token ``t``;
            0 where the response mask is 0.
        """
        self.module.eval()
        keys = [k for k in (*MODEL_INPUTS, "response_mask") if k in data.batch]
        batch = {k: data.batch[k] for k in keys}
        out = torch.zeros(batch["responses"].shape, dtype=torch.float32)
        groups = micro_batches(
            torch.arange(len(data)),
            batch["attention_mask"],
            self.config.forward_micro_batch_size_per_gpu,
            self.forward_max_tokens if self.packed else None,
            self.device,
            "critic.forward_max_token_len_per_gpu",
        )
        for rows in groups:
            mb = to_device(batch, rows, self.device)
            values = self._values(mb)
            out[rows] = torch.where(response_mask_of(mb) != 0, values, 0.0).float().cpu()
        reshard_all(self.module)
        return out

    def _train_mini_batch(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, float]:
        """Gradient accumulation over the micro-batches of one mini-batch, then one optimizer step."""
        cfg = self.config
        (total,) = global_sum([agg_count(response_mask_of(batch)[rows], cfg.loss_agg_mode)], self.device)
        sums: dict[str, float] = {}
        groups = micro_batches(
            rows,
            batch["attention_mask"],
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.ppo_max_token_len_per_gpu if self.packed else None,
            self.device,
            "critic.ppo_max_token_len_per_gpu",
        )
        for mb_rows in groups:
            mb = to_device(batch, mb_rows, self.device)
            mask = response_mask_of(mb)
            vpreds = self._values(mb)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds, mb["returns"], mb["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode
            )
            weight = agg_count(mask, cfg.loss_agg_mode) / total if total > 0 else 0.0
            (vf_loss * (weight * self.grad_scale)).backward()
            metrics = {
                "critic/vf_loss": vf_loss.item(),
                "critic/vf_clipfrac": vf_clipfrac.item(),
                "critic/vpred_mean": masked_mean(vpreds.detach(), mask).item(),
            }
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + weight * value
        out = finish_mini_batch(
            self.module, self.optimizer, self.lr_scheduler, cfg.optim.grad_clip, sums, self.device, "critic"
        )
        return {**out, "critic/micro_batches": float(len(groups))}

    def update_critic(self, data) -> dict[str, float]:
        """PPO epochs x mini-batches x micro-batches of the clipped value loss
        (``ppoflow.algos.compute_value_loss`` with ``cliprange_value``), one optimizer step per mini-batch.

        Args:
            data: DataProto with the model inputs, ``values`` (rollout-time, the clip centre) and
                ``returns`` (B, R), optionally ``response_mask``.

        Returns:
            metrics averaged over the optimizer steps (identical on every rank): ``critic/vf_loss``,
            ``critic/vf_clipfrac``, ``critic/vpred_mean``, ``critic/grad_norm``, ``critic/lr``,
            ``critic/skipped_steps``, ``critic/optimizer_steps``, ``critic/micro_batches``.
        """
        if self.optimizer is None:
            raise RuntimeError("this critic has no optimizer")
        cfg = self.config
        keys = [*MODEL_INPUTS, "values", "returns"] + [k for k in ("response_mask",) if k in data.batch]
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(f"update_critic needs columns {missing} (have {sorted(data.batch)})")
        batch = {k: data.batch[k] for k in keys}
        self.module.train()
        self.updates += 1
        seed = shuffle_seed(self.seed, data, self.updates)
        steps = [
            self._train_mini_batch(batch, rows)
            for rows in mini_batch_rows(len(data), self.mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed)
        ]
        self.module.eval()
        return summarize_steps(steps, "critic")
