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
      rollout_correction: {mis: geometric}                              # reject by the per-token mean ratio
      rollout_correction: {tis: token, tis_cap: 2.0, mis: token}        # IcePop: zero weight outside [0.5, 2]
      rollout_correction: {behaviour: sampler}                          # bypass: no old-log-prob pass

Each rejection level has its own default band (:data:`MIS_BANDS`): a token's ratio and a whole
sequence's product of ratios are judged by [0.5, 2], the per-token geometric mean by
[0.999, 1.001] (a mean of thousands of ratios barely moves). Bands that cannot mean what they say are
refused: a geometric band wider than :data:`GEOMETRIC_PLAUSIBLE` (it would reject only sequences
whose *average* token is off by that much), bounds with no ``mis`` level, and the sequence level's
default band past :data:`SEQUENCE_MIS_MAX_LENGTH` response tokens (the product of thousands of
ratios leaves [0.5, 2] for a quarter to two thirds of long sequences at bf16: measured in
docs/benchmarks.md). A rejected token weighs 0 in the policy loss and still counts in its normaliser
(``mis_normaliser: all``, the IcePop and MIS objectives); ``kept`` drops it from the loss, the
entropy and KL terms and the normaliser (what veRL's ``rollout_rs`` does).
"""

from __future__ import annotations

import inspect
from typing import Literal

from pydantic import Field, model_validator

from ppoflow.infra.config.names import Section
from ppoflow.infra.models.rollout_engines import engine_spec

__all__ = [
    "RolloutCorrectionConfig",
    "check_rollout_correction",
    "truncates_sampling",
    "MIS_BANDS",
    "GEOMETRIC_PLAUSIBLE",
    "SEQUENCE_MIS_MAX_LENGTH",
]

#: Each rejection level's default kept band of the trainer/sampler ratio.
MIS_BANDS: dict[str, tuple[float, float]] = {
    "token": (0.5, 2.0),
    "sequence": (0.5, 2.0),
    "geometric": (0.999, 1.001),
}
#: The widest geometric band that can reject anything real: the per-token geometric mean of a
#: sequence's ratios moves by ~1e-4-1e-3 between bf16 kernels (docs/algorithms.md).
GEOMETRIC_PLAUSIBLE = (0.9, 1.1)
#: Response lengths above which sequence-level rejection needs a band chosen for them: at 4,096
#: tokens 23-24% of sequences left [0.5, 2] (bf16 sampler and trainer, docs/benchmarks.md).
SEQUENCE_MIS_MAX_LENGTH = 2048


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
    mis_lower: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="MIS keeps ratios >= this; null: the level's default (token, sequence 0.5; geometric 0.999)",
    )
    mis_upper: float | None = Field(
        None,
        ge=1.0,
        description="MIS keeps ratios <= this; null: the level's default (token, sequence 2.0; geometric 1.001)",
    )
    mis_normaliser: Literal["all", "kept"] = Field(
        "all",
        description="what a rejected token counts for: 'all' (weight 0 in the policy loss, still counted "
        "in its normaliser and in the entropy and KL terms: the IcePop / MIS objective), 'kept' (dropped "
        "from the response mask: from the loss, the entropy and KL terms and the normaliser; veRL's "
        "rollout_rs)",
    )
    warn_rejected_share: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="an iteration whose rejection removes more than this share of its tokens or "
        "sequences says so: a warning in its log, 'rejected' in its console line and the metric "
        "correction/rejected_over_limit",
    )

    @property
    def band(self) -> tuple[float, float]:
        """The kept ratio band of ``mis``: the bounds given, else the level's default."""
        lower, upper = MIS_BANDS.get(self.mis, MIS_BANDS["token"])
        return (
            lower if self.mis_lower is None else self.mis_lower,
            upper if self.mis_upper is None else self.mis_upper,
        )

    @model_validator(mode="after")
    def _check_band(self) -> RolloutCorrectionConfig:
        """Bounds without a level, and geometric bounds too wide to reject anything real."""
        given = [
            f"{k}={getattr(self, k)}" for k in ("mis_lower", "mis_upper") if getattr(self, k) is not None
        ]
        if given and self.mis == "none":
            raise ValueError(
                f"algorithm.rollout_correction.{' and '.join(given)} with mis: none rejects nothing: set "
                "mis (token, sequence or geometric) or remove the bounds"
            )
        lower, upper = self.band
        low_ok, high_ok = GEOMETRIC_PLAUSIBLE
        if self.mis == "geometric" and (lower < low_ok or upper > high_ok):
            raise ValueError(
                f"algorithm.rollout_correction.mis=geometric with the band [{lower:g}, {upper:g}]: the "
                "geometric level judges a sequence by the per-token mean of its ratios, which bf16 "
                "kernels move by about 1e-4 to 1e-3, so this band rejects only sequences whose average "
                f"token is off by {max(1 / lower, upper):.3g}x. Use bounds close to 1 (leave them unset "
                f"for {MIS_BANDS['geometric'][0]} / {MIS_BANDS['geometric'][1]}), or mis: token to "
                "reject single tokens outside a wide band"
            )
        return self

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
    response_length: int,
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
    - TIS weights (and, with ``mis_normaliser: all``, the rejection's zero weights) reach the
      policy loss through its ``rollout_is_weights`` keyword;
    - sequence-level rejection at its default band is refused past
      :data:`SEQUENCE_MIS_MAX_LENGTH` response tokens (the module docstring says why).
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
    _check_weights_keyword(rc, policy_loss)
    _check_sequence_length(rc, response_length)


def _check_weights_keyword(rc: RolloutCorrectionConfig, policy_loss: str) -> None:
    """TIS weights, and with ``mis_normaliser: all`` the rejection's zero weights, reach the
    policy loss through its ``rollout_is_weights`` keyword: a loss without it is refused."""
    weighs = rc.tis != "none" or (rc.mis != "none" and rc.mis_normaliser == "all")
    if not weighs:
        return
    from ppoflow.algos import get_policy_loss

    if "rollout_is_weights" not in inspect.signature(get_policy_loss(policy_loss)).parameters:
        setting = f"tis={rc.tis}" if rc.tis != "none" else f"mis={rc.mis} (mis_normaliser: all)"
        raise ValueError(
            f"algorithm.rollout_correction.{setting} weighs each token's policy loss, but "
            f"actor.policy_loss={policy_loss!r} takes no rollout_is_weights keyword: add it to the loss "
            "(ppoflow.algos.policy_losses says how), or turn the correction off"
        )


def _check_sequence_length(rc: RolloutCorrectionConfig, response_length: int) -> None:
    """Sequence-level rejection at its default band past :data:`SEQUENCE_MIS_MAX_LENGTH`."""
    default_band = rc.mis_lower is None and rc.mis_upper is None
    if rc.mis == "sequence" and default_band and response_length > SEQUENCE_MIS_MAX_LENGTH:
        raise ValueError(
            f"algorithm.rollout_correction.mis=sequence with rollout.response_length={response_length}: "
            "a sequence's ratio is the product of its token ratios, and past "
            f"{SEQUENCE_MIS_MAX_LENGTH} tokens the default band [0.5, 2] rejects a quarter to two "
            "thirds of the sequences at bf16 (23-63% measured at 4k-16k, docs/benchmarks.md). Use "
            "mis: geometric (the per-token mean ratio, whose band does not depend on the length) or "
            "mis: token; or give mis_lower and mis_upper chosen for this length"
        )
