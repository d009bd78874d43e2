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
from ppoflow.workers.minibatch import MODEL_INPUTS, MiniBatchTrainer, response_mask_of

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.config import CriticConfig

__all__ = ["DataParallelPPOCritic"]


class DataParallelPPOCritic(MiniBatchTrainer):
    """PPO value estimates and updates for one rank of an FSDP critic.

    Args:
        config: the ``critic`` section.
        module: an FSDP-sharded ``ValueModel`` (the root).
        rollout_n: responses per prompt (a mini-batch is ``ppo_mini_batch_size * rollout_n`` rows).
        dp_size: data-parallel ranks sharing a mini-batch.
    """

    section = "critic"

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
        self.forward_max_tokens = config.forward_tokens

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
        out = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        for rows, mb in self._forward_batches(
            data,
            self.config.forward_micro_batch_size_per_gpu,
            self.forward_max_tokens if self.packed else None,
            "critic.forward_max_token_len_per_gpu",
        ):
            values = self._values(mb)
            out[rows] = torch.where(response_mask_of(mb) != 0, values, 0.0).float().cpu()
        return out

    def _micro_loss(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped value loss of one micro-batch (as ``agg_loss`` over this micro-batch) and its metrics."""
        cfg = self.config
        mask = response_mask_of(mb)
        vpreds = self._values(mb)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, mb["returns"], mb["values"], mask, cfg.cliprange_value, cfg.loss_agg_mode
        )
        metrics = {
            "critic/vf_loss": vf_loss.item(),
            "critic/vf_clipfrac": vf_clipfrac.item(),
            "critic/vpred_mean": masked_mean(vpreds.detach(), mask).item(),
        }
        return vf_loss, metrics

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
        keys = [*MODEL_INPUTS, "values", "returns"] + [k for k in ("response_mask",) if k in data.batch]
        return self._update(data, keys, "update_critic", self._micro_loss)
