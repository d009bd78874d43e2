"""``asynchronous``: training that does not wait for generation (docs/async.md).

A rollout producer (the ``ppo-rollout`` flow, a worker group of its own) samples the batches of
the iterations ahead into the experiment's queue on storage, and the ``ppo`` flow consumes batch n
in iteration n as soon as it is there. ``max_staleness`` bounds how old the policy that sampled a
token may be: every token of batch n was sampled by a version >= n - 1 - max_staleness (version v
is the policy after update v). 0 is the synchronous flow, exactly.

    asynchronous:
      enable: true
      max_staleness: 2
      in_flight: continue            # partial rollouts; or requeue
      chunk_tokens: 64
      producer: {nprocs: 1, visible_devices: "1"}   # the rollout group on its own GPU
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ppoflow.infra.config.names import Section
from ppoflow.infra.models.rollout_engines import engine_spec

__all__ = ["AsyncConfig", "ProducerPlacement", "check_asynchronous"]


class ProducerPlacement(Section):
    """Where the rollout producer's worker group runs. Unset fields are the ``resources`` section's
    (one GPU: both groups on device 0, sampling while the trainer updates)."""

    start: Literal["with_trainer", "external"] = Field(
        "with_trainer",
        description="with_trainer: the ppo flow starts the ppo-rollout flow in a process of its own "
        "on its machine, watches it (a dead one is started again) and stops it at the end; external: "
        "the ppo-rollout flow runs elsewhere (its own deployment, work pool and devices), the trainer "
        "only reads the queue",
    )
    nprocs: int | None = Field(
        None,
        ge=1,
        description="ranks of the rollout group (None: resources.nprocs; the same layout samples "
        "max_staleness 0 batches equal to the synchronous flow's)",
    )
    device: Literal["cpu", "cuda"] | None = Field(None, description="None: resources.device")
    visible_devices: str | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES of the rollout group's ranks, e.g. '1' for the second GPU "
        "(None: resources.visible_devices)",
    )
    threads_per_rank: int | None = Field(None, ge=1, description="None: resources.threads_per_rank")


class AsyncConfig(Section):
    """Asynchronous training: a staleness-bounded queue of rollouts between a producer and the
    trainer (module docstring)."""

    enable: bool = False
    max_staleness: int = Field(
        0,
        ge=0,
        description="s: every token of batch n was sampled by policy version >= n - 1 - s (the "
        "producer never runs further ahead; the trainer refuses a batch that breaks it). 0 commits "
        "exactly what the synchronous flow commits",
    )
    in_flight: Literal["continue", "requeue"] = Field(
        "continue",
        description="what a sequence being sampled does when a newer policy is published (s >= 1): "
        "continue under the new weights (partial rollouts; its tokens carry both versions), or "
        "requeue (sampled again from its prompt, in the same batch, under the new version)",
    )
    chunk_tokens: int = Field(
        64,
        ge=1,
        description="s >= 1: new tokens per engine call; between calls the producer loads a newer "
        "policy version if one was published",
    )
    wait_timeout_s: float = Field(
        3600.0, gt=0, description="how long the trainer waits for a batch before failing the iteration"
    )
    poll_s: float = Field(0.2, gt=0, description="how often a waiting producer or trainer looks at the queue")
    lease_stale_after_s: float = Field(
        60.0,
        gt=0,
        description="a producer's lease on a batch whose heartbeat is older than this is taken over "
        "(at once when its process on this host is gone)",
    )
    admission: str | None = Field(
        None,
        description="the producer's choice of which batches it may start: 'module:Class' (a module "
        "or .py file; the class takes this section and has admissible(committed, latest, until)); "
        "None: the bound above (ppoflow.infra.queue.admission)",
    )
    producer: ProducerPlacement = Field(default_factory=ProducerPlacement)

    def first_version(self, n: int) -> int:
        """The oldest policy version that may sample a token of batch ``n``."""
        return max(0, n - 1 - self.max_staleness)


def check_asynchronous(cfg: Any) -> None:
    """The settings asynchronous training cannot run with, in ``cfg`` (an ``ExperimentConfig``):
    a ValueError naming the fix."""
    a = cfg.asynchronous
    if not a.enable:
        return
    algorithm, rollout, actor = cfg.algorithm, cfg.rollout, cfg.actor
    refused = [
        (
            algorithm.overlap != "none",
            "algorithm.overlap=one_step (max_staleness: 1 is its asynchronous form)",
        ),
        (algorithm.dynamic_sampling.enable, "algorithm.dynamic_sampling (it scores rounds while generating)"),
        (rollout.multi_turn.enable, "rollout.multi_turn (episodes are sampled in one piece)"),
        (actor.lora.enabled, "actor.lora (the published policy versions are full weights)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"asynchronous.enable with {what}: not supported together; turn one of them off")
    logs = engine_spec(rollout.engine).can("always_log_probs") or rollout.calculate_log_probs
    if a.max_staleness >= 1 and not logs:
        raise ValueError(
            f"asynchronous.max_staleness={a.max_staleness}: every token must carry the log-prob of "
            "the policy version that sampled it; set rollout.calculate_log_probs=true"
        )
    nprocs = a.producer.nprocs or cfg.resources.nprocs
    sp = actor.sequence_parallel_size
    if nprocs % sp or nprocs % rollout.tensor_model_parallel_size:
        raise ValueError(
            f"asynchronous.producer.nprocs={nprocs} must be a multiple of actor.sequence_parallel_size="
            f"{sp} and rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} (the "
            "rollout group samples with the actor's layout)"
        )
