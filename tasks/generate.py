"""``generate``: the next prompt batch, sampled responses, and the actor's old log-probs.

Reads the prompt batch at the manifest's data cursor, writes ``iterations/n/prompts.arrow``,
then runs ``ActorRolloutRefWorker.generate_sequences`` on the actor group holding the actor of
iteration n-1 (the worker puts those weights into the rollout engine: read from the checkpoint the
group loaded on its first rollout, from the live module later), and writes ``rollout.arrow``.

Sampling seeds depend only on (config seed, rollout seed, iteration): the prompt batch carries
``meta_info["seed"]``, from which the rollout seeds each request (with the replica and the row),
so a retried or resumed iteration samples exactly what an uninterrupted one would.

With ``algorithm.dynamic_sampling`` (DAPO) the task runs rounds: each takes the next
``data.train_batch_size`` prompts from the cursor, samples them (round r > 0 with the seed
:func:`round_seed`), scores the responses with the rule / custom function and keeps the groups
whose scores differ, until ``data.train_batch_size`` groups are kept (the first ones, in data
order) or ``max_rounds`` rounds fail to fill the batch (a :class:`DataError` naming the numbers).
Round 0 writes ``prompts.arrow`` and ``rollout-r0.arrow``, round r ``prompts-r{r}.arrow`` and
``rollout-r{r}.arrow``; the kept groups go to ``rollout.arrow``. Rounds depend only on the cursor
and the seeds, so a retried generate commits the same batch, and the cursor moves past every
prompt sampled. Metrics: ``rollout/generation_rounds``, ``rollout/filtered_groups_share`` (the
groups sampled that scored all alike); the engine's ``rollout/*`` metrics are the last round's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast
from uuid import UUID

import numpy as np
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.prompts import DataCursor, DataError
from ppoflow.infra.experiment.metrics import reduce_rank_metrics
from ppoflow.infra.remote.contracts import ACTOR_ROLE
from ppoflow.infra.rewards.remote import run_reward
from ppoflow.infra.rewards.rollout_batch import outcome_scores
from ppoflow.tasks.receipts import GenerateReceipt
from ppoflow.tasks.run.inputs import iteration_seed, round_seed
from ppoflow.tasks.step import Step, ppo_task

__all__ = ["generate", "iteration_seed", "round_seed", "keep_informative_groups"]


def keep_informative_groups(batch: DataProto, scores: list[float], wanted: int) -> tuple[DataProto, int, int]:
    """The rows of the first ``wanted`` groups (``uid``) of ``batch`` whose ``scores`` differ, in
    row order; how many groups ``batch`` has, and how many of them scored all alike."""
    from ppoflow.algos import informative_groups

    uids = batch.non_tensor_batch["uid"].tolist()
    keep = informative_groups(scores, np.asarray(uids, dtype=object))
    informative = list(dict.fromkeys(u for u, k in zip(uids, keep) if k))
    chosen = set(informative[:wanted])
    rows = np.asarray([u in chosen for u in uids], dtype=bool)
    total = len(set(uids))
    return batch[rows], total, total - len(informative)


@dataclass
class _Rounds:
    """What the rounds of one generation tallied (dynamic sampling: groups kept and sampled)."""

    wanted: int
    kept: list[DataProto] = field(default_factory=list)
    groups: int = 0
    generated: int = 0
    alike: int = 0
    truncated: int = 0
    metrics: list[dict] = field(default_factory=list)

    def keep(self, batch: DataProto, scores: list[float]) -> bool:
        """Keep the informative groups of a round's ``batch``; True once the batch is full."""
        part, in_round, alike = keep_informative_groups(batch, scores, self.wanted - self.groups)
        self.generated, self.alike = self.generated + in_round, self.alike + alike
        self.groups += len(set(part.non_tensor_batch["uid"].tolist()))
        self.kept.append(part)
        return self.groups >= self.wanted

    def check_full(self, n: int, max_rounds: int) -> None:
        if self.groups < self.wanted:
            raise DataError(
                f"dynamic sampling: {max_rounds} generation rounds of iteration {n} found "
                f"{self.groups} of the {self.wanted} prompt groups a batch needs whose responses scored "
                f"differently (the other {self.alike} scored all alike: no gradient signal). "
                "Raise algorithm.dynamic_sampling.max_rounds, use prompts the policy sometimes "
                "solves, or disable dynamic sampling"
            )


def _prompts(
    step: Step[GenerateReceipt], cursor: DataCursor, r: int, url: str
) -> tuple[int, DataCursor, int]:
    """Write round ``r``'s prompt batch from ``cursor`` at ``url``: (rows, next cursor, truncated)."""
    cfg = step.cfg
    meta = {"iteration": step.n, "seed": round_seed(cfg.seed, cfg.rollout.seed, step.n, r)}
    prompts, next_cursor, truncated = step.ctx.inputs.write_prompts(cursor, meta, url)
    return len(prompts), next_cursor, truncated


@ppo_task("generate", GenerateReceipt)
def generate(step: Step[GenerateReceipt], rollout_actor: str, cursor: DataCursor) -> GenerateReceipt:
    """Roll out iteration ``n`` from data ``cursor`` with the actor of ``rollout_actor`` (n-1; n-2
    with one-step overlap).

    Outputs ``prompts``, ``rollout``; metrics ``rollout/*``, ``weight_sync_s``, ``data/*``.
    """
    cfg, n = step.cfg, step.n
    # a sync task: prefect's async_dispatch runs the sync implementation (typed UUID | Coroutine)
    progress = cast(UUID, create_progress_artifact(0.0, description=f"iteration {n}: generation"))
    dynamic = cfg.algorithm.dynamic_sampling
    prompts_url, rollout_url = step.file("prompts.arrow"), step.file("rollout.arrow")
    actor = None
    tally = _Rounds(cfg.data.train_batch_size)
    next_cursor = cursor
    for r in range(dynamic.max_rounds if dynamic.enable else 1):
        where = f"round {r}, epoch {next_cursor['epoch']} offset {next_cursor['offset']}"
        round_prompts = prompts_url if r == 0 else step.file(f"prompts-r{r}.arrow")
        round_rollout = step.file(f"rollout-r{r}.arrow") if dynamic.enable else rollout_url
        rows, next_cursor, truncated = _prompts(step, next_cursor, r, round_prompts)
        tally.truncated += truncated
        update_progress_artifact(progress, 10.0, description=f"iteration {n}: {rows} prompts ({where})")
        actor = actor or step.worker(ACTOR_ROLE, rollout_actor)
        update_progress_artifact(
            progress, 20.0, description=f"iteration {n}: actor group ready, sampling {rows} x {cfg.rollout.n}"
        )
        actor.generate_sequences(round_prompts, out_url=round_rollout)
        if not dynamic.enable:
            tally.metrics.append(DataProto.load(rollout_url, columns=[]).meta_info.get("metrics") or {})
            break
        batch = DataProto.load(round_rollout)
        tally.metrics.append(batch.meta_info.get("metrics") or {})
        if tally.keep(batch, _scores(step, batch)):
            break
    if dynamic.enable:
        tally.check_full(n, dynamic.max_rounds)
        DataProto.concat(tally.kept).save(rollout_url)
    update_progress_artifact(progress, 100.0, description=f"iteration {n}: rollout written")
    return step.receipt(
        outputs={"prompts": prompts_url, step.output_key: rollout_url},
        metrics=_metrics(tally, dynamic.enable, cursor),
        next_cursor=next_cursor,
        seed=iteration_seed(cfg.seed, cfg.rollout.seed, n),
        truncated_prompts=tally.truncated,
    )


def _metrics(tally: _Rounds, dynamic: bool, cursor: DataCursor) -> dict[str, float]:
    """The receipt's metrics: the engine's of the last round, dynamic sampling's, the data's."""
    metrics = reduce_rank_metrics(tally.metrics[-1:])
    if "rollout/weight_sync_s" in metrics:  # the name the UI table lists it under
        metrics["weight_sync_s"] = metrics["rollout/weight_sync_s"]
    if dynamic:
        metrics["rollout/generation_rounds"] = float(len(tally.metrics))
        metrics["rollout/filtered_groups_share"] = tally.alike / tally.generated if tally.generated else 0.0
    metrics["data/truncated_prompts"] = float(tally.truncated)
    metrics["data/epoch"] = float(cursor["epoch"])
    return metrics


def _scores(step: Step[GenerateReceipt], batch: DataProto) -> list[float]:
    """The rule / custom-function score of each response of a round, or the environment's of
    each episode (what dynamic sampling compares within a group: the outcome, before any shaping)."""
    return outcome_scores(batch, step.ctx.inputs.tokenizer, run_reward(step.cfg.reward))
