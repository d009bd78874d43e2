"""``algorithm.rollout_correction``: which policy is the behaviour policy, and how the update
corrects for the sampler not being the trainer (docs/algorithms.md, "Sampler vs trainer").

The rollout engine samples with its own kernels (and dtype, and, in asynchronous or one-step
overlapped training, older weights) than the FSDP actor that recomputes ``old_log_probs``. With
``rollout.calculate_log_probs`` on (the default) the engine's own log-probs come back with the
rollout, the ``advantage`` task measures the difference every iteration (``mismatch/*``), and the
settings here choose what the update does about it. The names are those of the literature:
TIS (truncated importance sampling), MIS (masked importance sampling, i.e. rejection by ratio;
IcePop masks tokens the same way), veRL's ``rollout_correction`` for the whole, its bypass mode
for ``behaviour: sampler``.

    algorithm:
      rollout_correction: {tis: token, tis_cap: 2.0}                    # TIS (Yao et al., 2025)
      rollout_correction: {mis: geometric, mis_lower: 0.999, mis_upper: 1.001}
      rollout_correction: {tis: token, tis_cap: 2.0, mis: token}        # IcePop: mask outside [0.5, 2]
      rollout_correction: {behaviour: sampler}                          # bypass: no old-log-prob pass
"""

from __future__ import annotations

import inspect
from typing import Literal

from pydantic import Field, model_validator

from ppoflow.infra.config.names import Section
from ppoflow.infra.rollout_engines import engine_spec

__all__ = ["RolloutCorrectionConfig", "check_rollout_correction", "truncates_sampling"]


class RolloutCorrectionConfig(Section):
    """The behaviour policy of the PPO update and the correction between sampler and trainer."""

    behaviour: Literal["trainer", "sampler"] = Field(
        "trainer",
        description="the PPO ratio's denominator: 'trainer' = the FSDP actor's recompute of the "
        "sampled tokens (old_log_probs; the corrections below weigh trainer against sampler); "
        "'sampler' = the engine's own log-probs (rollout_log_probs) as old_log_probs, which skips "
        "the recompute in generate and its time (veRL's bypass mode; no mismatch/* metrics then: "
        "there is nothing to compare with)",
    )
    tis: Literal["none", "token", "sequence"] = Field(
        "none",
        description="truncated importance sampling: each token's policy loss times "
        "min(pi_old / pi_sampler, tis_cap), the ratio per token or of the whole sequence",
    )
    tis_cap: float = Field(2.0, ge=1.0, description="the TIS truncation C (the TIS paper's: 2)")
    mis: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="masked importance sampling / rejection: tokens (token), sequences (sequence: "
        "the product of their ratios; geometric: the per-token geometric mean) whose ratio "
        "pi_old / pi_sampler leaves [mis_lower, mis_upper] get no actor loss",
    )
    mis_lower: float = Field(0.5, gt=0.0, le=1.0, description="MIS keeps ratios >= this")
    mis_upper: float = Field(
        2.0,
        ge=1.0,
        description="MIS keeps ratios <= this (geometric: bounds close to 1, e.g. 0.999 / 1.001)",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        if self.behaviour == "sampler" and self.corrects:
            raise ValueError(
                "algorithm.rollout_correction.behaviour=sampler makes the sampler's log-probs the "
                "PPO ratio's denominator: the trainer/sampler ratio that tis and mis weigh by is then "
                "never computed (PPO's clip on pi / pi_sampler is the correction). Set tis and mis "
                "to none, or behaviour to trainer"
            )
        return self

    @property
    def corrects(self) -> bool:
        """Whether TIS or MIS is on."""
        return self.tis != "none" or self.mis != "none"

    @property
    def needs_sampler_log_probs(self) -> bool:
        """Whether the update reads the engine's log-probs (a correction, or the bypass)."""
        return self.corrects or self.behaviour == "sampler"


def truncates_sampling(top_p: float, top_k: int) -> bool:
    """Whether the rollout samples from a truncated distribution (nucleus or top-k)."""
    return top_p < 1.0 or top_k > 0


def check_rollout_correction(
    rc: RolloutCorrectionConfig,
    *,
    engine: str,
    calculate_log_probs: bool,
    top_p: float,
    top_k: int,
    policy_loss: str,
) -> None:
    """The checks ``algorithm.rollout_correction`` (``rc``) needs across sections, given the
    ``rollout`` section's settings and ``actor.policy_loss`` (ValueError naming the fix):

    - a correction or the bypass reads the engine's log-probs: an engine without
      ``always_log_probs`` (vLLM) must be asked for them;
    - with ``top_p`` < 1 or ``top_k`` > 0 the engine's log-prob of a token is under its truncated,
      renormalised distribution (vLLM's ``processed_logprobs``) while the trainer's is under the
      full one: the ratio then also carries the kept mass ``Z`` of every token (a factor <= 1 per
      token, a product over a sequence), and no weight corrects for the tokens outside the kept set,
      which the sampler never draws. Correcting (or bypassing) against it would be biased, so the
      combination is refused; the mismatch metrics still run (docs/algorithms.md says what they
      then measure);
    - TIS weights reach the policy loss through its ``rollout_is_weights`` keyword.
    """
    if not rc.needs_sampler_log_probs:
        return
    what = (
        "algorithm.rollout_correction.behaviour=sampler"
        if rc.behaviour == "sampler"
        else "algorithm.rollout_correction ("
        + ", ".join(f"{k}={getattr(rc, k)}" for k in ("tis", "mis") if getattr(rc, k) != "none")
        + ")"
    )
    if not engine_spec(engine).can("always_log_probs") and not calculate_log_probs:
        raise ValueError(
            f"{what} reads the engine's log-probs of the sampled tokens: set rollout.calculate_log_probs=true"
        )
    if truncates_sampling(top_p, top_k):
        raise ValueError(
            f"{what} with rollout.top_p={top_p}, rollout.top_k={top_k}: the engine's "
            "log-probs are then of its truncated, renormalised distribution and the trainer's of the "
            "full one, so their ratio is biased by the truncation and no weight can correct for the "
            "tokens the sampler never draws. Sample from the full distribution (rollout.top_p=1.0, "
            "rollout.top_k=-1; lower rollout.temperature for less randomness), or turn the "
            "correction off (tis: none, mis: none, behaviour: trainer)"
        )
    if rc.tis != "none":
        from ppoflow.algos import get_policy_loss

        loss = policy_loss
        if "rollout_is_weights" not in inspect.signature(get_policy_loss(loss)).parameters:
            raise ValueError(
                f"algorithm.rollout_correction.tis={rc.tis} weighs each token's policy loss, but "
                f"actor.policy_loss={loss!r} takes no rollout_is_weights keyword: add it to the loss "
                "(ppoflow.algos.policy_losses says how) or set tis: none"
            )
