"""How far the sampler's policy is from the trainer's, measured on the tokens the sampler drew.

The rollout engine (vLLM) samples with its own kernels, batching and often dtype; the FSDP actor
then recomputes the log-prob of every sampled token. The two disagree even with identical weights
(bf16 rounding in different kernels), and by much more when the engine holds stale weights. PPO's
ratio assumes they agree. These are the per-iteration measures of how much they do not.

Notation, per response token t of sequence i (``response_mask`` = 1): ``mu = sampler_log_probs``
(the engine's log-prob of the token it drew, from the distribution it drew it from),
``pi = trainer_log_probs`` (the FSDP actor's recompute), ``d = pi - mu`` and ``r = exp(d)`` the
trainer/sampler ratio. The tokens are samples of the sampler, so expectations over them are
expectations under ``mu``:

- ``kl_k1`` = ``mean(-d)``: Schulman's k1 estimate of KL(sampler || trainer) (unbiased, can be
  negative on a finite batch);
- ``kl_k3`` = ``mean(r - 1 - d)``: Schulman's k3 estimate of the same KL (unbiased, >= 0, low
  variance when the two are close);
- ``token_mult_prob_error`` = ``mean(exp(|d|))``: NeMo-RL's figure (1 = identical; its nightly
  tests require < 1.1): the average factor by which the two probabilities of a token differ;
- ``abs_log_ratio_mean``, ``abs_log_ratio_max`` = mean and largest ``|d|`` (the largest is where a
  stale weight or a broken kernel shows first);
- ``ppl_ratio`` = the mean over sequences of ``ppl_trainer_i / ppl_sampler_i``, with
  ``ppl_i = exp(-mean_t log p)`` the sequence's perplexity: ``exp(mean_t(-d))`` per sequence
  (veRL reports the same); ``trainer_ppl``, ``sampler_ppl`` the two perplexities' means;
- ``token_ratio_outside`` = the share of tokens whose ``r`` lies outside ``[low, high]``
  (default [0.5, 2]: a probability off by more than a factor 2);
- ``seq_ratio_outside`` = the share of sequences whose ratio ``exp(sum_t d)`` (the importance
  ratio of the whole sequence, what sequence-level importance sampling uses) lies outside it;
- ``geo_ratio_outside`` = the share of sequences whose per-token geometric mean ratio
  ``exp(mean_t d)`` lies outside ``GEOMETRIC_BOUNDS`` ([0.999, 1.001]: the geometric level's default
  band). With the two shares above, what each rejection level's default band would reject;
- ``tokens``, ``sequences``: how many response tokens and non-empty sequences were measured.

"Mean" is over all response tokens of the batch (token-mean), "over sequences" over the rows with
at least one response token. Everything is computed in float64. ``exp`` of a log-ratio is taken on
``d`` clamped to +-20 (as the policy losses clamp theirs), so a token the trainer gives probability
~0 counts as a factor e^20 instead of inf; ``abs_log_ratio_max`` is not clamped. A batch without a
response token gives the values of two identical policies (0 KL, error 1, ratios 1, shares 0).

The ratio is only meaningful when both log-probs are of the same distribution: with ``top_p`` < 1
or ``top_k`` > 0 the engine reports the log-prob under its truncated, renormalised distribution
(vLLM's ``processed_logprobs``), the trainer under the full one, and ``d`` also holds
``log Z`` (the kept mass, <= 0) of every token. docs/algorithms.md says what ppoflow does then.
"""

from __future__ import annotations

import torch

from ppoflow.algos.masked import masked_mean

__all__ = ["MISMATCH_BOUNDS", "GEOMETRIC_BOUNDS", "LOG_RATIO_CLAMP", "mismatch_metrics"]

#: The ratio band outside which a token or sequence counts as off (a factor of 2 either way).
MISMATCH_BOUNDS = (0.5, 2.0)
#: The band of a sequence's per-token geometric mean ratio (``geo_ratio_outside``).
GEOMETRIC_BOUNDS = (0.999, 1.001)
#: |log-ratio| beyond which ``exp`` is taken of the clamped value (as the policy losses do).
LOG_RATIO_CLAMP = 20.0


def _mean_over(values: torch.Tensor, rows: torch.Tensor, empty: float) -> float:
    """Mean of (B,) ``values`` over the ``rows`` flagged (``empty`` when none is)."""
    return float(values[rows].mean()) if bool(rows.any()) else empty


def _sequence_metrics(
    pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> dict[str, float]:
    """The per-sequence measures (module docstring) over the rows with a response token."""
    has = (mask != 0).any(dim=-1)
    lengths = mask.sum(-1).clamp(min=1.0)
    mean_pi, mean_mu = (pi * mask).sum(-1) / lengths, (mu * mask).sum(-1) / lengths
    cap = LOG_RATIO_CLAMP
    seq_ratio = torch.exp(((pi - mu) * mask).sum(-1).clamp(-cap, cap))
    geo_ratio = torch.exp((mean_pi - mean_mu).clamp(-cap, cap))
    geo_low, geo_high = GEOMETRIC_BOUNDS
    return {
        "sequences": float(has.sum()),
        "ppl_ratio": _mean_over(torch.exp((mean_mu - mean_pi).clamp(-cap, cap)), has, 1.0),
        "trainer_ppl": _mean_over(torch.exp((-mean_pi).clamp(max=10 * cap)), has, 1.0),
        "sampler_ppl": _mean_over(torch.exp((-mean_mu).clamp(max=10 * cap)), has, 1.0),
        "seq_ratio_outside": _mean_over(((seq_ratio < low) | (seq_ratio > high)).double(), has, 0.0),
        "geo_ratio_outside": _mean_over(((geo_ratio < geo_low) | (geo_ratio > geo_high)).double(), has, 0.0),
    }


def mismatch_metrics(
    trainer_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    low: float = MISMATCH_BOUNDS[0],
    high: float = MISMATCH_BOUNDS[1],
) -> dict[str, float]:
    """The sampler/trainer mismatch of one batch (definitions in the module docstring).

    Args:
        trainer_log_probs: (B, R) the trainer's log-probs of the sampled tokens (``old_log_probs``).
        sampler_log_probs: (B, R) the engine's log-probs of the same tokens (``rollout_log_probs``).
        response_mask: (B, R) 1 on the response tokens to measure (padding, and a multi-turn
            episode's environment tokens, are 0; values there are never read, NaN included).
        low, high: the ratio band of ``token_ratio_outside`` / ``seq_ratio_outside``, ``0 < low < high``.

    Returns:
        ``{name: float}`` with the keys ``tokens``, ``sequences``, ``kl_k1``, ``kl_k3``,
        ``token_mult_prob_error``, ``abs_log_ratio_mean``, ``abs_log_ratio_max``, ``ppl_ratio``,
        ``trainer_ppl``, ``sampler_ppl``, ``token_ratio_outside``, ``seq_ratio_outside``,
        ``geo_ratio_outside``.
    """
    if not 0 < low < high:
        raise ValueError(f"the ratio band needs 0 < low < high, got [{low}, {high}]")
    if trainer_log_probs.shape != sampler_log_probs.shape or trainer_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_log_probs.shape)}, sampler "
            f"{tuple(sampler_log_probs.shape)}, mask {tuple(response_mask.shape)}"
        )
    valid = response_mask != 0
    mask = valid.to(torch.float64)
    pi = torch.where(valid, trainer_log_probs.detach().to(torch.float64), 0.0)
    mu = torch.where(valid, sampler_log_probs.detach().to(torch.float64), 0.0)
    d = pi - mu
    dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(dc)
    if not bool(valid.any()):  # nothing measured: the values of two identical policies
        tokens = {"kl_k1": 0.0, "kl_k3": 0.0, "token_mult_prob_error": 1.0, "abs_log_ratio_mean": 0.0}
        tokens.update(abs_log_ratio_max=0.0, token_ratio_outside=0.0)
    else:
        tokens = {
            "kl_k1": float(masked_mean(-d, mask)),
            "kl_k3": float(masked_mean(ratio - 1.0 - dc, mask)),
            "token_mult_prob_error": float(masked_mean(torch.exp(dc.abs()), mask)),
            "abs_log_ratio_mean": float(masked_mean(d.abs(), mask)),
            "abs_log_ratio_max": float(d.abs()[valid].max()),
            "token_ratio_outside": float(masked_mean(((ratio < low) | (ratio > high)).double(), mask)),
        }
    return {"tokens": float(mask.sum()), **tokens, **_sequence_metrics(pi, mu, mask, low, high)}
