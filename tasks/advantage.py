"""``advantage``: rewards and advantages on the CPU of the flow process.

1. ``token_level_scores`` (B, R): ``reward.rm_weight * rm_scores`` (reward model) plus the rule /
   custom score of the decoded response placed on its last response token
   (:mod:`ppoflow.infra.rewards.rollout_batch`); for multi-turn episodes (an ``env_scores`` column) the
   environment's rewards instead of the rule / custom score (the built-in ``tools`` environment
   applies that function to the final answer itself).
2. ``token_level_rewards``: with ``algorithm.use_kl_in_reward`` the scores minus
   ``beta * KL(old || ref)`` per token (``ppoflow.algos.apply_kl_penalty``); the KL controller's
   coefficient comes from the manifest of iteration n-1 and its updated value goes into the
   receipt (``AdvantageReceipt.kl_coef``), which ``commit`` stores in manifest n. Otherwise the scores.
   (KL as a loss, ``actor.use_kl_loss``, happens in ``update_actor`` with ``ref_log_prob``.)
   With ``algorithm.adv_estimator: distill`` (on-policy distillation, docs/distillation.md) the
   teacher's per-token reward ``coef * (teacher_log_prob - old_log_probs)``
   (``ppoflow.algos.teacher_rewards``) takes the scores' place (they are still measured); with a
   teacher the metric ``distill/reverse_kl`` is the mean over response tokens of
   ``old_log_probs - teacher_log_prob``.
3. ``advantages``, ``returns`` by ``algorithm.adv_estimator`` (GAE with the critic's values;
   GRPO / RLOO group the responses of one prompt by ``uid``; ``distill`` discounts with
   ``algorithm.distill.gamma``).

DAPO's settings: ``reward.overlong_buffer`` adds the soft overlong penalty
(``ppoflow.algos.overlong_penalty``) to the score on the last response token (step 1);
``algorithm.filter_overlong_responses`` zeroes the response mask of the responses cut at
``rollout.response_length`` after step 3, so they get no loss. Metrics: ``response/truncated_share``,
``response/overlong_penalty_mean``, ``response/filtered_overlong``.

The sampler/trainer mismatch (``mismatch/*``) and ``algorithm.rollout_correction``'s columns and
metrics (``correction/*``): ``ppoflow.tasks.mismatch``.

Writes ``advantages.arrow``: the whole training batch (rollout + ref log-probs + values + rm
scores + the four new columns), the one input of both updates.
"""

from __future__ import annotations

from typing import Any

import torch

from ppoflow.algos import (
    apply_kl_penalty,
    compute_advantage,
    get_kl_controller,
    masked_mean,
    overlong_penalty,
    teacher_rewards,
    truncated_rows,
)
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.metrics import compute_data_metrics
from ppoflow.infra.experiment.tracking import SAMPLES_FILE
from ppoflow.infra.rewards.remote import run_reward
from ppoflow.infra.rewards.rollout_batch import (
    decode_prompts,
    is_multi_turn,
    on_last_token,
    outcome_texts,
    rule_scores,
)
from ppoflow.tasks.graph import output_of
from ppoflow.tasks.mismatch import measure_and_correct, rejection_warning
from ppoflow.tasks.receipts import AdvantageReceipt, GenerateReceipt, Receipt
from ppoflow.tasks.step import Step, ppo_task, shorten

__all__ = ["advantage", "kl_controller", "overlong_rows"]


def kl_controller(cfg: ExperimentConfig, kl_coef: float | None):
    """The configured KL controller. An adaptive one continues from ``kl_coef`` (its state in the
    manifest) when given; a fixed one always uses the config's coefficient."""
    kc = cfg.algorithm.kl_ctrl
    if kc.type == "adaptive":
        coef = kc.kl_coef if kl_coef is None else kl_coef
        return get_kl_controller("adaptive", kl_coef=coef, target_kl=kc.target_kl, horizon=kc.horizon)
    return get_kl_controller("fixed", kl_coef=kc.kl_coef)


def _token_level_scores(cfg: ExperimentConfig, batch: DataProto, tokenizer: Any) -> torch.Tensor:
    mask = batch.batch["response_mask"]
    scores = torch.zeros(mask.shape, dtype=torch.float32)
    if "rm_scores" in batch.batch:
        scores += cfg.reward.rm_weight * batch.batch["rm_scores"].float()
    if is_multi_turn(batch):  # the environment scored each turn and the episode
        scores += batch.batch["env_scores"].float()
    elif cfg.reward.rule or cfg.reward.custom_function or cfg.reward.remote:
        scores += on_last_token(rule_scores(batch, tokenizer, run_reward(cfg.reward)), mask)
    if cfg.reward.overlong_buffer.enable:
        scores += on_last_token(_overlong_penalty(cfg, mask), mask)
    return scores


def overlong_rows(batch: DataProto, max_length: int) -> torch.Tensor:
    """(B,) bool: the rows cut at the length budget (``filter_overlong_responses``): a response
    that used all ``max_length`` tokens, or a multi-turn episode whose policy and environment
    tokens did (or that the budget ended before its next turn, ``budget_ended``)."""
    width = batch.batch["responses"].shape[1]
    episode = batch.batch["attention_mask"][:, -width:]  # single-turn: the response mask itself
    return truncated_rows(episode, max_length, batch.batch.get("budget_ended"))


def _overlong_penalty(cfg: ExperimentConfig, mask: torch.Tensor) -> torch.Tensor:
    """DAPO's soft length penalty of each response (``reward.overlong_buffer``)."""
    return overlong_penalty(
        mask.sum(-1),
        cfg.rollout.response_length,
        cfg.overlong_buffer_length(),
        cfg.reward.overlong_buffer.penalty_factor,
    )


def _overlong_metrics(cfg: ExperimentConfig, mask: torch.Tensor) -> dict[str, float]:
    """The share of responses cut at the length limit, and DAPO's overlong penalty on average."""
    truncated = truncated_rows(mask, cfg.rollout.response_length)
    out = {"response/truncated_share": float(truncated.float().mean()) if len(mask) else 0.0}
    if cfg.reward.overlong_buffer.enable:
        penalty = _overlong_penalty(cfg, mask)
        out["response/overlong_penalty_mean"] = float(penalty.mean()) if len(mask) else 0.0
    return out


def _with_teacher(
    cfg: ExperimentConfig,
    batch: DataProto,
    scores: torch.Tensor,
    rewards: torch.Tensor,
    metrics: dict[str, float],
) -> tuple[torch.Tensor, float]:
    """The rewards and the estimator's discount, with a teacher's part. For the ``distill``
    estimator the task's ``scores`` leave the rewards (measured, not trained on: ``distill+rl``
    trains on both) and the teacher's per-token reward enters, discounted by
    ``algorithm.distill.gamma``. With any teacher, the student's distance from it per token
    (``distill/reverse_kl``, the k1 estimate) goes into ``metrics``."""
    if "teacher_log_prob" not in batch.batch:
        return rewards, cfg.algorithm.gamma
    mask, student, teacher = (batch.batch[k] for k in ("response_mask", "old_log_probs", "teacher_log_prob"))
    metrics["distill/reverse_kl"] = float(masked_mean(student - teacher, mask)) if mask.any() else 0.0
    if cfg.algorithm.adv_estimator != "distill":
        return rewards, cfg.algorithm.gamma
    distill = cfg.algorithm.distill
    return rewards - scores + teacher_rewards(student, teacher, mask, distill.coef), distill.gamma


@ppo_task("advantage", AdvantageReceipt)
def advantage(
    step: Step[AdvantageReceipt], generate: GenerateReceipt, gathered: list[Receipt], kl_coef: float | None
) -> AdvantageReceipt:
    """Rewards, KL penalty and advantages of iteration ``n``.

    Args:
        generate: the rollout's receipt (``generate``'s, or ``consume``'s).
        gathered: the receipts of the score steps that ran (``ref_log_prob``, ``values``, ...).
        kl_coef: the KL controller's coefficient after iteration n-1 (None: the config's).
    """
    cfg = step.cfg
    batch = DataProto.load(generate.output("rollout"))
    for receipt in gathered:
        batch = batch.union(DataProto.load(receipt.output(output_of(receipt.task))))
    mask = batch.batch["response_mask"]
    scores = _token_level_scores(cfg, batch, step.ctx.inputs.tokenizer)
    metrics: dict[str, float] = {}
    rewards, new_kl = scores, kl_coef
    if cfg.algorithm.use_kl_in_reward:
        ctrl = kl_controller(cfg, kl_coef)
        rewards, kl_metrics = apply_kl_penalty(
            scores,
            batch.batch["old_log_probs"],
            batch.batch["ref_log_prob"],
            mask,
            ctrl,
            kind=cfg.algorithm.kl_penalty,
        )
        metrics.update(kl_metrics)
        new_kl = ctrl.value
    rewards, gamma = _with_teacher(cfg, batch, scores, rewards, metrics)
    adv, ret = compute_advantage(
        cfg.algorithm.adv_estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        values=batch.batch.get("values"),
        index=batch.non_tensor_batch["uid"],
        gamma=gamma,
        lam=cfg.algorithm.lam,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
    )
    batch.batch.update(
        token_level_scores=scores, token_level_rewards=rewards, advantages=adv.float(), returns=ret.float()
    )
    metrics.update(compute_data_metrics(batch.batch))
    metrics.update(_overlong_metrics(cfg, mask))
    metrics.update(measure_and_correct(cfg, batch))  # sampler vs trainer (tasks/mismatch.py)
    warning = rejection_warning(cfg, metrics)
    if warning is not None:
        step.logger.warning(warning)
    if cfg.algorithm.filter_overlong_responses:
        truncated = overlong_rows(batch, cfg.rollout.response_length)
        batch.batch["response_mask"] = mask * (~truncated).unsqueeze(-1).to(mask.dtype)
        metrics["response/filtered_overlong"] = float(truncated.sum())
    out = step.file("advantages.arrow")
    batch.save(out)
    if cfg.evaluation.samples_shown:
        _samples_artifact(step, batch, cfg.evaluation.samples_shown)
    return step.receipt(outputs={step.output_key: out}, metrics=metrics, kl_coef=new_kl)


def _samples_artifact(step: Step[AdvantageReceipt], batch: DataProto, rows: int) -> None:
    """A table artifact of the iteration's first ``rows`` training rollouts: prompt, response,
    score, reward and advantage (what one opens first when a run looks wrong); its rows are kept
    in ``samples.json`` too, for the trackers."""
    from prefect.artifacts import create_table_artifact

    tok = step.ctx.inputs.tokenizer
    head = batch[: min(rows, len(batch))]
    episodes = is_multi_turn(head)  # the whole episode, environment turns too
    responses = outcome_texts(head, tok)
    prompts = decode_prompts(head, tok)
    mask = head.batch["response_mask"]
    table = [
        {
            "row": i,
            "data_source": str(head.non_tensor_batch["data_source"][i]),
            "prompt": shorten(prompts[i]),
            "response": shorten(responses[i], 1500 if episodes else 300),
            **({"turns": int(head.batch["num_turns"][i])} if "num_turns" in head.batch else {}),
            "score": round(float((head.batch["token_level_scores"][i] * mask[i]).sum()), 4),
            "reward": round(float((head.batch["token_level_rewards"][i] * mask[i]).sum()), 4),
            "advantage": round(
                float(head.batch["advantages"][i][mask[i].bool()].mean()) if mask[i].any() else 0.0, 4
            ),
        }
        for i in range(len(head))
    ]
    storage.write_json_atomic(step.file(SAMPLES_FILE), table)
    create_table_artifact(
        table,
        key=f"{step.slug}-rollouts",
        description=f"iteration {step.n}: the first {len(head)} training rollouts",
    )
