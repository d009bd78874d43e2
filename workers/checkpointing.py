"""The checkpoint methods of a worker that trains one model: save (in the background or not),
wait for the write, load (verified); the actor's and the critic's workers share them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ppoflow.infra.checkpoint.writer import CheckpointWriter
from ppoflow.infra.remote.rank.worker import Dispatch, register

if TYPE_CHECKING:
    from ppoflow.infra.config import ExperimentConfig

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """Mixin for a ``Worker``: ``save_checkpoint``, ``wait_checkpoint`` and ``load_checkpoint`` of
    the model ``_trained()`` returns (an object with ``module``, ``optimizer``, ``lr_scheduler``).
    ``_checkpoint_loaded(url)`` runs after a load (the actor points its rollout engine there)."""

    cfg: ExperimentConfig
    checkpoints: CheckpointWriter

    def _init_checkpoints(self) -> None:
        self.checkpoints = CheckpointWriter(
            attempts=self.cfg.checkpoint.write_attempts, threads=self.cfg.checkpoint.write_threads
        )

    def _trained(self) -> Any:
        raise NotImplementedError

    def _checkpoint_loaded(self, url: str) -> None:
        """Called on every rank after ``load_checkpoint``; nothing by default."""

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self,
        url: str,
        extra: dict[str, Any] | None = None,
        background: bool = False,
        weights_only: bool = False,
        dtype: str | None = None,
    ) -> dict[str, Any]:
        """Sharded DCP checkpoint (model, optimizer, LR schedule; ``weights_only``: the model alone)
        at ``url``; ``background``: return once staged in host memory, the write goes on (see
        ``ppoflow.infra.checkpoint.writer``); ``dtype`` (weights only): the model's floating-point
        tensors written in it (``"bfloat16"``). Returns this rank's timings."""
        model = self._trained()
        optimizer = None if weights_only else model.optimizer
        scheduler = None if weights_only else model.lr_scheduler
        cast = None if dtype is None else getattr(torch, dtype)
        return self.checkpoints.save(
            url, model.module, optimizer, scheduler, extra, background=background, dtype=cast
        )

    @register(Dispatch.ONE_TO_ALL)
    def wait_checkpoint(self) -> dict[str, Any] | None:
        """Wait for the background checkpoint write; its result, ``{url, error}`` if it failed."""
        return self.checkpoints.wait(raise_errors=False)

    @register(Dispatch.ONE_TO_ALL)
    def checkpoint_write_status(self) -> dict[str, Any] | None:
        """The background write without waiting: None, or ``{url, running}`` plus ``error`` once it
        failed (a failure the writer could not record on storage, a full disk say, is seen here)."""
        return self.checkpoints.status()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, url: str, with_optimizer: bool = True) -> dict[str, Any]:
        """Load the model from ``url`` (any world size / mesh); returns the checkpoint's ``extra``.
        The files read are verified first (``checkpoint.verify``)."""
        from ppoflow.infra.checkpoint.sharded import load_checkpoint

        model = self._trained()
        self.checkpoints.wait(raise_errors=False)  # never read what this rank is still writing
        optimizer = model.optimizer if with_optimizer else None
        scheduler = model.lr_scheduler if with_optimizer else None
        extra = load_checkpoint(url, model.module, optimizer, scheduler, verify=self.cfg.checkpoint.verify)
        self._checkpoint_loaded(url)
        return extra
