"""Mini-batches and micro-batches of a PPO update, shared by the actor and the critic.

Every rank holds an equal share of the batch (the driver splits it). An update is PPO epochs x
mini-batches (``ppo_mini_batch_size * rollout.n`` rows over all ranks, shuffled per epoch from the
run's seed and the iteration) x micro-batches, with one optimizer step per mini-batch.

Gradient accumulation is exact: each micro-batch's loss is weighted by its share of the whole
mini-batch *across all data-parallel ranks* (tokens for ``token-mean``, sequences with at least one
response token for the ``seq-mean-*`` modes), so one optimizer step equals one step on the whole
mini-batch in a single process, whatever the micro-batch size, rank count or padding lengths.

With ``use_dynamic_bsz`` a micro-batch is not a fixed number of rows but as many rows as fit
``ppo_max_token_len_per_gpu`` real tokens (``log_prob_max_token_len_per_gpu`` for log-probs), and it
runs packed: the padding is dropped before the model (``ppoflow.workers.packing``). The weighting
above does not depend on how rows are split, so the update is the same step.

Sequence parallel (a module with a ``sequence_parallel`` layout of size sp): the sp ranks of a
group hold the same rows, a packed micro-batch holds up to ``sp x`` the per-GPU token budget
(each rank runs 1/sp of its tokens), and the global counts above count the group's rows sp
times, which the gathered outputs' gradient (sp times the loss's on each rank) makes exact
(``ppoflow.workers.sequence_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ppoflow.workers.fsdp_utils import reshard_all
from ppoflow.workers.optim import finish_mini_batch, global_sum
from ppoflow.workers.packing import token_budget_micro_batches

if TYPE_CHECKING:  # annotations only: the worker layer runs without pydantic (benchmarks)
    from ppoflow.infra.data.dataproto import DataProto

__all__ = [
    "MODEL_INPUTS",
    "MiniBatchTrainer",
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

# One micro-batch's loss (as ``agg_loss`` over the micro-batch) and its metrics.
MicroLoss = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


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


def summarize_steps(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Mean of each metric over the optimizer steps that have it (a skipped step has only its step
    metrics); ``*/lr`` is the last value, ``*/skipped_steps`` a sum; adds ``<prefix>/optimizer_steps``
    (mini-batches, stepped or skipped)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for s in steps for k in s):
        values = [s[key] for s in steps if key in s]
        if key.endswith("/lr"):
            out[key] = values[-1]
        elif key.endswith("/skipped_steps"):
            out[key] = sum(values)
        else:
            finite = [v for v in values if math.isfinite(v)]
            out[key] = sum(finite) / len(finite) if finite else float("nan")
    out[f"{prefix}/optimizer_steps"] = float(len(steps))
    return out


class MiniBatchTrainer:
    """What the actor and the critic share: the mini-batch size, the forward-only pass over a
    batch, and the update loop with its exact gradient accumulation (see the module docstring).

    ``section`` names the config section and the metric prefix ("actor", "critic"). The subclass
    gives each micro-batch's loss (a ``MicroLoss``) to ``_update``.
    """

    section = ""

    def __init__(
        self,
        config: Any,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any,
        *,
        rollout_n: int,
        dp_size: int,
        device: torch.device | str,
        seed: int,
    ):
        self.config, self.module = config, module
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.device = torch.device(device)
        self.dp_size, self.seed, self.updates = dp_size, seed, 0
        self.rollout_n = rollout_n
        self.grad_scale = world_size()
        self.packed = bool(config.use_dynamic_bsz)
        layout = getattr(module, "sequence_parallel", None)
        self.sp_size = layout.size if layout is not None else 1

    @property
    def mini_batch_size(self) -> int:
        """Rows of one mini-batch on this rank: ``ppo_mini_batch_size * rollout_n / dp_size``."""
        return mini_batch_rows_per_rank(
            self.config.ppo_mini_batch_size, self.rollout_n, self.dp_size, self.section
        )

    def _forward_batches(
        self, data: DataProto, size: int, max_tokens: int | None, field: str
    ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """In eval mode, ``(rows, micro-batch on the device)`` over all of ``data``'s rows (the model
        inputs and ``response_mask``; micro-batches as in ``micro_batches``); the module is
        resharded once the last one has been consumed."""
        self.module.eval()
        batch = {k: data.batch[k] for k in (*MODEL_INPUTS, "response_mask") if k in data.batch}
        groups = micro_batches(
            torch.arange(len(data)),
            batch["attention_mask"],
            size,
            None if max_tokens is None else max_tokens * self.sp_size,
            self.device,
            field,
        )
        for rows in groups:
            yield rows, to_device(batch, rows, self.device)
        reshard_all(self.module)

    def _update(
        self, data: DataProto, keys: list[str], method: str, micro_loss: MicroLoss
    ) -> dict[str, float]:
        """PPO epochs x mini-batches of the columns ``keys`` (KeyError naming ``method`` if one is
        missing), one optimizer step each; the metrics summarised over the steps."""
        missing = [k for k in keys if k not in data.batch]
        if missing:
            raise KeyError(f"{method} needs columns {missing} (have {sorted(data.batch)})")
        cfg = self.config
        batch = {k: data.batch[k] for k in keys}
        self.module.train()
        self.updates += 1
        seed = shuffle_seed(self.seed, data, self.updates)
        steps = [
            self._train_mini_batch(batch, rows, micro_loss)
            for rows in mini_batch_rows(len(data), self.mini_batch_size, cfg.ppo_epochs, cfg.shuffle, seed)
        ]
        self.module.eval()
        return summarize_steps(steps, self.section)

    def _contributing(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> float:
        """How many of ``rows``' response tokens can move the loss (here: every masked-in token; the
        actor leaves out what its rollout correction weighs 0 when nothing else reads them)."""
        return float((response_mask_of(batch)[rows] != 0).sum())

    def _skipped(self) -> dict[str, float]:
        """The metrics of a mini-batch with no contributing token: no optimizer or schedule step."""
        assert self.optimizer is not None
        return {
            f"{self.section}/lr": self.optimizer.param_groups[0]["lr"],
            f"{self.section}/skipped_steps": 1.0,
            f"{self.section}/micro_batches": 0.0,
        }

    def _train_mini_batch(
        self, batch: dict[str, torch.Tensor], rows: torch.Tensor, micro_loss: MicroLoss
    ) -> dict[str, float]:
        """Gradient accumulation over the micro-batches of one mini-batch, then one optimizer step.

        A mini-batch in which no token can move the loss on any rank (every token rejected by the
        rollout correction, or no response tokens) runs no micro-batch and takes no step: its zero
        gradient would still move AdamW's moments, decay the weights and advance the schedule
        (``<section>/skipped_steps`` counts it; every rank decides the same from the global count)."""
        cfg = self.config
        mask = response_mask_of(batch)[rows]
        total, contributing = global_sum(
            [agg_count(mask, cfg.loss_agg_mode), self._contributing(batch, rows)], self.device
        )
        if contributing == 0:
            return self._skipped()
        sums: dict[str, float] = {}
        groups = micro_batches(
            rows,
            batch["attention_mask"],
            cfg.ppo_micro_batch_size_per_gpu,
            cfg.update_tokens * self.sp_size if self.packed else None,
            self.device,
            f"{self.section}.ppo_max_token_len_per_gpu",
        )
        for mb_rows in groups:
            mb = to_device(batch, mb_rows, self.device)
            loss, metrics = micro_loss(mb)
            weight = agg_count(response_mask_of(mb), cfg.loss_agg_mode) / total if total > 0 else 0.0
            (loss * (weight * self.grad_scale)).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + weight * value
        assert self.optimizer is not None  # built with one to update
        out = finish_mini_batch(
            self.module,
            self.optimizer,
            self.lr_scheduler,
            cfg.optim.grad_clip,
            sums,
            self.device,
            self.section,
        )
        return {**out, f"{self.section}/micro_batches": float(len(groups))}
