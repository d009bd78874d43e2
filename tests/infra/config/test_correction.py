"""``algorithm.rollout_correction`` and the loss settings it meets: what is accepted, and the one
error that names the problem and the fix for what is not."""

from __future__ import annotations

import pytest
import torch

from ppoflow.algos import get_policy_loss, register_policy_loss
from ppoflow.algos.policy_losses import POLICY_LOSSES
from ppoflow.infra.config import ConfigError, parse_config

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}}
ON = {"rollout": {"calculate_log_probs": True}}


def _cfg(**sections):
    data = {**BASE, **ON, **sections}
    return parse_config(data)


def _error(**sections) -> str:
    with pytest.raises(ConfigError) as err:
        _cfg(**sections)
    return str(err.value)


def test_defaults_measure_and_correct_nothing():
    cfg = parse_config(BASE)
    rc = cfg.algorithm.rollout_correction
    assert (rc.behaviour, rc.tis, rc.mis, rc.tis_cap, rc.mis_lower, rc.mis_upper) == (
        "trainer",
        "none",
        "none",
        2.0,
        None,
        None,
    )
    assert rc.mis_normaliser == "all" and rc.warn_rejected_share == 0.1
    assert not rc.needs_sampler_log_probs


@pytest.mark.parametrize(
    "level, band", [("token", (0.5, 2.0)), ("sequence", (0.5, 2.0)), ("geometric", (0.999, 1.001))]
)
def test_each_rejection_level_has_its_own_default_band(level, band):
    rc = _cfg(algorithm={"rollout_correction": {"mis": level}}).algorithm.rollout_correction
    assert rc.band == band and rc.mis_lower is None  # the config keeps "the level's default"
    given = {"mis": level, "mis_lower": 0.99, "mis_upper": 1.01}
    assert _cfg(algorithm={"rollout_correction": given}).algorithm.rollout_correction.band == (0.99, 1.01)


def test_a_geometric_band_too_wide_to_reject_anything_is_refused():
    text = _error(algorithm={"rollout_correction": {"mis": "geometric", "mis_lower": 0.5, "mis_upper": 2.0}})
    assert "mis=geometric with the band [0.5, 2]" in text and "off by 2x" in text
    assert "0.999 / 1.001" in text and "mis: token" in text
    upper = _error(algorithm={"rollout_correction": {"mis": "geometric", "mis_upper": 1.2}})
    assert "band [0.999, 1.2]" in upper and "off by 1.2x" in upper
    ok = {"mis": "geometric", "mis_lower": 0.95, "mis_upper": 1.05}  # wide, but it can reject
    assert _cfg(algorithm={"rollout_correction": ok}).algorithm.rollout_correction.band == (0.95, 1.05)


def test_bounds_without_a_rejection_level_are_refused():
    text = _error(algorithm={"rollout_correction": {"tis": "token", "mis_upper": 1.5}})
    assert "mis_upper=1.5 with mis: none rejects nothing" in text


def test_sequence_rejection_at_its_default_band_is_refused_past_2048_tokens():
    seq = {"algorithm": {"rollout_correction": {"mis": "sequence"}}}
    assert _cfg(**seq, rollout={"calculate_log_probs": True, "response_length": 2048})
    text = _error(**seq, rollout={"calculate_log_probs": True, "response_length": 4096})
    assert "mis=sequence with rollout.response_length=4096" in text
    assert "mis: geometric" in text and "mis: token" in text and "docs/benchmarks.md" in text
    chosen = {"algorithm": {"rollout_correction": {"mis": "sequence", "mis_lower": 0.1, "mis_upper": 10.0}}}
    assert _cfg(**chosen, rollout={"calculate_log_probs": True, "response_length": 4096})  # a band for it
    for level in ("token", "geometric"):  # their bands do not grow with the length
        long = {"calculate_log_probs": True, "response_length": 16384}
        assert _cfg(rollout=long, algorithm={"rollout_correction": {"mis": level}})


@pytest.mark.parametrize(
    "rc",
    [
        {"tis": "token"},
        {"tis": "sequence", "tis_cap": 5.0},
        {"mis": "geometric", "mis_lower": 0.999, "mis_upper": 1.001},
        {"tis": "token", "mis": "token"},  # IcePop
        {"behaviour": "sampler"},
    ],
)
def test_corrections_and_the_bypass_are_accepted_with_the_engines_log_probs(rc):
    cfg = _cfg(algorithm={"rollout_correction": rc})
    assert cfg.algorithm.rollout_correction.needs_sampler_log_probs
    hf = parse_config({**BASE, "rollout": {"engine": "hf"}, "algorithm": {"rollout_correction": rc}})
    assert hf.rollout.engine == "hf"  # the HF engine always returns them


@pytest.mark.parametrize(
    "sections, needles",
    [
        (
            {
                "rollout": {"calculate_log_probs": False},
                "algorithm": {"rollout_correction": {"tis": "token"}},
            },
            ["tis=token", "set rollout.calculate_log_probs=true"],
        ),
        (
            {"algorithm": {"rollout_correction": {"behaviour": "sampler", "mis": "token"}}},
            ["behaviour=sampler", "Set tis and mis to none, or behaviour to trainer"],
        ),
        (
            {
                "rollout": {"calculate_log_probs": True, "top_p": 0.9},
                "algorithm": {"rollout_correction": {"mis": "token"}},
            },
            ["top_p=0.9", "truncated, renormalised", "rollout.top_p=1.0", "rollout.top_k=-1"],
        ),
        (
            {
                "rollout": {"calculate_log_probs": True, "top_k": 50},
                "algorithm": {"rollout_correction": {"behaviour": "sampler"}},
            },
            ["behaviour=sampler", "top_k=50", "turn the correction off"],
        ),
        (
            {"algorithm": {"rollout_correction": {"mis": "token", "mis_lower": 1.2}}},
            ["mis_lower"],
        ),
        ({"algorithm": {"rollout_correction": {"tis": "token", "tis_cap": 0.5}}}, ["tis_cap"]),
        ({"algorithm": {"rollout_correction": {"tis": "geometric"}}}, ["tis", "'token' or 'sequence'"]),
    ],
)
def test_what_cannot_work_is_refused_with_the_fix(sections, needles):
    text = _error(**sections)
    for needle in needles:
        assert needle in text, text


def test_truncated_sampling_alone_is_fine_the_metrics_still_run():
    cfg = _cfg(rollout={"calculate_log_probs": True, "top_p": 0.9, "top_k": 20})
    assert cfg.rollout.top_p == 0.9


def test_a_loss_without_the_weights_keyword_is_refused_only_where_weights_reach_it():
    @register_policy_loss("test_plain_pg")
    def plain_pg(old_log_prob, log_prob, advantages, response_mask, **_clips):  # no rollout_is_weights
        return -(advantages * log_prob * response_mask).sum(), {}

    try:
        kept = {"mis": "token", "mis_normaliser": "kept"}  # rejected tokens leave the mask: no weights
        assert _cfg(actor={"policy_loss": "test_plain_pg"}, algorithm={"rollout_correction": kept})
        for rc, setting in (({"tis": "token"}, "tis=token"), ({"mis": "token"}, "mis=token")):
            text = _error(actor={"policy_loss": "test_plain_pg"}, algorithm={"rollout_correction": rc})
            assert setting in text and "takes no rollout_is_weights keyword" in text, text
            assert "turn the correction off" in text
    finally:
        POLICY_LOSSES.pop("test_plain_pg")


def test_clip_ratio_low_above_one_is_cispos_no_lower_bound():
    """CISPO recipes elsewhere write clip_ratio_low: 10; ratios are positive, so it is no lower
    bound, as 1.0 is: accepted for cispo (the loss is the same), explained for the others."""
    cfg = parse_config({**BASE, "actor": {"policy_loss": "cispo", "clip_ratio_low": 10.0}})
    assert cfg.actor.clip_ratio_low == 10.0
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    new = (old + 2.0 * torch.randn(3, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv, mask = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.ones(3, 5)
    ten, _ = get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=10.0, clip_ratio_high=0.28)
    one, _ = get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=1.0, clip_ratio_high=0.28)
    assert ten.item() == one.item()
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "actor": {"policy_loss": "vanilla", "clip_ratio_low": 10.0}})
    text = str(err.value)
    assert "actor.clip_ratio_low=10" in text and "Only policy_loss 'cispo'" in text and "write 1.0" in text
