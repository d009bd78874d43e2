"""The sampler/trainer mismatch of an iteration's batch, and its correction, in the ``advantage`` task.

Both run once on the whole batch in the flow process (CPU, a few vectorised passes over (B, R)):
exact over the batch, with nothing to merge across data-parallel shards. The update tasks read the
result from ``advantages.arrow``:

- ``mismatch/*`` metrics (``ppoflow.algos.mismatch``) whenever the rollout carries the engine's
  log-probs (``rollout_log_probs``: ``rollout.calculate_log_probs`` with vLLM, always with the HF
  engine) and ``old_log_probs`` is the trainer's recompute (``behaviour: trainer``; with
  ``behaviour: sampler`` the two columns are the same numbers and there is nothing to measure);
- with ``algorithm.rollout_correction.tis`` the column ``rollout_is_weights`` (B, R), with
  ``mis`` the column ``rollout_rs_mask`` (B, R) (``ppoflow.algos.correction``), and the
  ``correction/*`` metrics. The actor multiplies each token's policy loss by its weight and drops
  the rejected tokens' weight to 0 (``mis_normaliser: all``) or drops them from its response mask
  (``kept``) (``ppoflow.workers.actor``); the critic, the advantages and ``response_mask`` itself
  are left as they are. An iteration whose rejection removes more than
  ``warn_rejected_share`` of its tokens or sequences also gets ``correction/rejected_over_limit``
  (the larger share) and a warning in the task's log (:func:`rejection_warning`).
"""

from __future__ import annotations

from ppoflow.algos import correction_metrics, mismatch_metrics, rejection_mask, truncated_is_weights
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data.dataproto import DataProto

__all__ = ["measure_and_correct", "rejection_warning", "IS_WEIGHTS", "RS_MASK", "SAMPLER_LOG_PROBS"]

SAMPLER_LOG_PROBS = "rollout_log_probs"
IS_WEIGHTS = "rollout_is_weights"
RS_MASK = "rollout_rs_mask"


def measure_and_correct(cfg: ExperimentConfig, batch: DataProto) -> dict[str, float]:
    """The ``mismatch/*`` and ``correction/*`` metrics of ``batch``; adds the correction's columns
    to it (see the module docstring). Reads ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask`` (B, R); returns ``{}`` when there is nothing to compare."""
    rc = cfg.algorithm.rollout_correction
    if SAMPLER_LOG_PROBS not in batch.batch or rc.behaviour == "sampler":
        return {}
    trainer, sampler = batch.batch["old_log_probs"], batch.batch[SAMPLER_LOG_PROBS]
    mask = batch.batch["response_mask"]
    metrics = {f"mismatch/{k}": v for k, v in mismatch_metrics(trainer, sampler, mask).items()}
    if not rc.corrects:
        return metrics
    weights = kept = None
    if rc.tis != "none":
        weights = truncated_is_weights(trainer, sampler, mask, rc.tis, rc.tis_cap)
        batch.batch[IS_WEIGHTS] = weights
    if rc.mis != "none":
        kept = rejection_mask(trainer, sampler, mask, rc.mis, *rc.band)
        batch.batch[RS_MASK] = kept
    cap = rc.tis_cap if weights is not None else None
    corrected = correction_metrics(mask, weights, kept, cap)
    metrics.update({f"correction/{k}": v for k, v in corrected.items()})
    rejected = max(corrected["masked_token_share"], corrected["masked_seq_share"])
    if kept is not None and rejected > rc.warn_rejected_share:
        metrics["correction/rejected_over_limit"] = rejected
    return metrics


def rejection_warning(cfg: ExperimentConfig, metrics: dict[str, float]) -> str | None:
    """The warning for an iteration whose rejection went over ``warn_rejected_share`` (None if not)."""
    if "correction/rejected_over_limit" not in metrics:
        return None
    rc = cfg.algorithm.rollout_correction
    lower, upper = rc.band
    return (
        f"the rollout correction (mis: {rc.mis}, band [{lower:g}, {upper:g}]) rejected "
        f"{metrics['correction/masked_token_share']:.1%} of the response tokens and "
        f"{metrics['correction/masked_seq_share']:.1%} of the sequences, more than "
        f"warn_rejected_share={rc.warn_rejected_share:g}: what is rejected does not train the actor. "
        "Look at mismatch/* (a stale or broken engine shows there first); a band too tight for "
        "the engine's precision or the response length rejects what is only rounding (mis: geometric "
        "or token, or wider bounds)"
    )
