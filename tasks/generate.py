"""``generate``: the next prompt batch, sampled responses, and the actor's old log-probs.

Reads the prompt batch at the manifest's data cursor, writes ``iterations/n/prompts.arrow``,
then runs ``ActorRolloutRefWorker.generate_sequences`` on the actor group holding the actor of
iteration n-1 (the worker puts those weights into the rollout engine: read from the checkpoint the
group loaded on its first rollout, from the live module later), and writes ``rollout.arrow``.

Sampling seeds depend only on (config seed, rollout seed, iteration): the prompt batch carries
``meta_info["seed"]``, from which the rollout seeds each request (with the replica and the row),
so a retried or resumed iteration samples exactly what an uninterrupted one would.
"""

from __future__ import annotations

from typing import cast
from uuid import UUID

import numpy as np
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.tasks.receipts import GenerateReceipt
from ppoflow.tasks.step import Step, ppo_task

__all__ = ["generate", "iteration_seed"]


def iteration_seed(seed: int, rollout_seed: int, n: int) -> int:
    """The sampling seed of iteration ``n``: a function of the config's seeds and ``n`` only."""
    return int(np.random.SeedSequence([int(seed), int(rollout_seed), int(n)]).generate_state(1)[0] >> 1)


@ppo_task("generate", GenerateReceipt, roles=("actor",))
def generate(step: Step[GenerateReceipt], actor_checkpoint: str, cursor: DataCursor) -> GenerateReceipt:
    """Roll out iteration ``n`` from data ``cursor`` with the actor of ``actor_checkpoint``.

    Outputs ``prompts``, ``rollout``; metrics ``rollout/*``, ``weight_sync_s``, ``data/*``.
    """
    cfg, ctx, n = step.cfg, step.ctx, step.n
    # a sync task: prefect's async_dispatch runs the sync implementation (typed UUID | Coroutine)
    progress = cast(UUID, create_progress_artifact(0.0, description=f"iteration {n}: generation"))
    rows, next_cursor = ctx.inputs.dataset.take(
        cursor, cfg.data.train_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle
    )
    seed = iteration_seed(cfg.seed, cfg.rollout.seed, n)
    prompts, stats = ctx.inputs.dataset.tokenize(
        rows,
        ctx.inputs.tokenizer,
        prompt_length=cfg.rollout.prompt_length,
        apply_chat_template=cfg.data.apply_chat_template,
        meta_info={"iteration": n, "seed": seed},
        truncation=cfg.data.truncation,
    )
    prompts_url, rollout_url = step.file("prompts.arrow"), step.file("rollout.arrow")
    prompts.save(prompts_url)
    where = f"epoch {cursor['epoch']} offset {cursor['offset']}"
    update_progress_artifact(progress, 10.0, description=f"iteration {n}: {len(rows)} prompts from {where}")
    actor = step.worker("actor", actor_checkpoint)
    update_progress_artifact(
        progress,
        20.0,
        description=f"iteration {n}: actor group ready, sampling {len(rows)} x {cfg.rollout.n}",
    )
    actor.generate_sequences(prompts_url, out_url=rollout_url)
    meta = DataProto.load(rollout_url, columns=[]).meta_info
    update_progress_artifact(progress, 100.0, description=f"iteration {n}: rollout written")
    metrics = reduce_rank_metrics([meta.get("metrics") or {}])
    if "rollout/weight_sync_s" in metrics:  # the name the UI table lists it under
        metrics["weight_sync_s"] = metrics["rollout/weight_sync_s"]
    metrics["data/truncated_prompts"] = float(stats["truncated"])
    metrics["data/epoch"] = float(cursor["epoch"])
    return step.receipt(
        outputs={"prompts": prompts_url, "rollout": rollout_url},
        metrics=metrics,
        next_cursor=next_cursor,
        seed=seed,
        truncated_prompts=int(stats["truncated"]),
    )
