"""The sampler/trainer mismatch end to end on 2 CPU ranks with vLLM: a sampler that deliberately
holds stale weights (``PPOFLOW_FAULT=rank_skip:weight_push:<rank>``) is measured, corrected and
still commits; the bypass (``behaviour: sampler``) trains from the engine's log-probs.

The stale run continues ``base_run`` (two committed iterations of GAE with a reward model: updates
that move the weights) for a third: its engine is built from the base model and skips the push of
checkpoint 2, so it samples from the weights of two updates before the trainer's. The reference:
``base_run``'s own iterations, whose engine held the right weights (float32 on both sides). The
bypass continues ``light_run`` (one worker group).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.configs import LIGHT
from tests.support.experiments import copy_experiment
from tests.support.hf_log_probs import response_log_probs

pytestmark = pytest.mark.slow

#: float32 vLLM against the float32 FSDP actor, same weights: measured ~1e-6 per token (CPU).
SAME_WEIGHTS_ERROR = 1.0001
LOW, HIGH, CAP = 0.95, 1.05, 1.02


def test_a_stale_sampler_is_measured_masked_capped_and_the_run_commits(
    base_run, flow_config, flow_assets, tmp_path, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    fresh = storage.read_json(ExperimentPaths(base_run["url"]).file(2, "metrics.json"))
    assert fresh["mismatch/token_mult_prob_error"] < SAME_WEIGHTS_ERROR  # the right weights: ~1

    copy_experiment(base_run["url"], str(tmp_path), "stale", at=2)
    monkeypatch.setenv(faults.ENV_VAR, "rank_skip:weight_push:0,rank_skip:weight_push:1")
    over = {
        # IcePop's shape with a band the tiny model's drift reaches (it samples near-uniformly:
        # two updates move its token probabilities by a few percent, not by a factor of 2)
        "algorithm.rollout_correction.tis": "token",
        "algorithm.rollout_correction.tis_cap": CAP,
        "algorithm.rollout_correction.mis": "token",
        "algorithm.rollout_correction.mis_lower": LOW,
        "algorithm.rollout_correction.mis_upper": HIGH,
    }
    cfg = flow_config(str(tmp_path), "stale", **over)
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 3  # it committed
    m = storage.read_json(paths.file(3, "metrics.json"))
    batch = DataProto.load(paths.file(3, "advantages.arrow"))
    mask = batch.batch["response_mask"].bool()
    sampler, trainer = batch.batch["rollout_log_probs"], batch.batch["old_log_probs"]
    # the engine sampled from the base weights: its log-probs are the base model's, not the trainer's
    base = response_log_probs(flow_assets["model"], batch, float(batch.meta_info.get("temperature", 1.0)))
    assert float((sampler - base)[mask].abs().max()) < 1e-4
    # the metrics show it
    d = (trainer - sampler)[mask].double()
    assert m["mismatch/token_mult_prob_error"] == pytest.approx(float(d.abs().exp().mean()), rel=1e-6)
    assert m["mismatch/token_mult_prob_error"] > 1.05 > SAME_WEIGHTS_ERROR
    assert m["mismatch/abs_log_ratio_max"] > 10 * fresh["mismatch/abs_log_ratio_max"]
    assert m["mismatch/kl_k3"] > 0 and m["mismatch/tokens"] == float(mask.sum())
    # the correction masks exactly the tokens outside [LOW, HIGH] and caps the weights at CAP
    ratio = torch.exp(trainer.double() - sampler.double())
    outside = mask & ((ratio < LOW) | (ratio > HIGH))
    kept = batch.batch["rollout_rs_mask"].bool()
    assert bool(outside.any()) and bool((mask & ~outside).any())
    assert torch.equal(kept, mask & ~outside)
    weights = batch.batch["rollout_is_weights"]
    assert torch.allclose(weights[mask].double(), ratio[mask].clamp(max=CAP), rtol=1e-6)
    assert m["correction/masked_token_share"] == pytest.approx(float(outside.sum() / mask.sum()))
    assert 0 < m["correction/capped_token_share"] < 1 and m["correction/weight_max"] <= CAP + 1e-6
    # the update ran on what was kept (response_mask itself is the rollout's)
    assert np.isfinite(m["actor/pg_loss"]) and m["actor/optimizer_steps"] >= 1
    assert torch.equal(mask, DataProto.load(paths.file(3, "rollout.arrow")).batch["response_mask"].bool())
    shown = (
        "token_mult_prob_error",
        "kl_k3",
        "abs_log_ratio_max",
        "token_ratio_outside",
        "seq_ratio_outside",
    )
    print(
        "\nstale sampler: "
        + ", ".join(
            f"{k} {m[f'mismatch/{k}']:.4g} (right weights {fresh[f'mismatch/{k}']:.4g})" for k in shown
        )
        + f"; masked {m['correction/masked_token_share']:.3f}, capped {m['correction/capped_token_share']:.3f}"
    )


def test_the_bypass_trains_from_the_engines_log_probs(light_run, flow_config, tmp_path):
    """``behaviour: sampler``: old_log_probs are the engine's own, no recompute, no mismatch
    metrics (nothing to compare), and the iteration commits."""
    from ppoflow.flows.ppo import ppo

    copy_experiment(light_run, str(tmp_path), "bypass", at=2)
    cfg = flow_config(
        str(tmp_path), "bypass", **LIGHT, **{"algorithm.rollout_correction.behaviour": "sampler"}
    )
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 3
    rollout = DataProto.load(paths.file(3, "rollout.arrow"))
    assert torch.equal(rollout.batch["old_log_probs"], rollout.batch["rollout_log_probs"])
    m = storage.read_json(paths.file(3, "metrics.json"))
    assert not [k for k in m if k.startswith(("mismatch/", "correction/"))]
    fresh = storage.read_json(ExperimentPaths(light_run).file(2, "metrics.json"))
    assert m["perf/old_log_prob_s"] < fresh["perf/old_log_prob_s"]
    assert np.isfinite(m["actor/pg_loss"])


def test_corrections_compose_with_gspo_and_one_step_overlap(light_run, flow_config, tmp_path):
    """Sequence-level TIS and geometric rejection with GSPO's loss, two iterations with one-step
    overlap (iteration 4 generated while update 3 runs): both commit, the columns and metrics are
    there, and the engine and the trainer (same weights, float32) agree, so nothing is masked."""
    from ppoflow.flows.ppo import ppo

    copy_experiment(light_run, str(tmp_path), "overlap", at=2)
    over = {
        **LIGHT,
        "actor.policy_loss": "gspo",
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.overlap": "one_step",
        "algorithm.rollout_correction.tis": "sequence",
        "algorithm.rollout_correction.mis": "geometric",
        "algorithm.rollout_correction.mis_lower": 0.999,
        "algorithm.rollout_correction.mis_upper": 1.001,
    }
    cfg = flow_config(str(tmp_path), "overlap", **over)
    ppo(cfg, iterations=2)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 4
    for n in (3, 4):
        m = storage.read_json(paths.file(n, "metrics.json"))
        batch = DataProto.load(paths.file(n, "advantages.arrow"))
        mask = batch.batch["response_mask"].bool()
        assert m["mismatch/token_mult_prob_error"] < SAME_WEIGHTS_ERROR
        assert torch.equal(batch.batch["rollout_rs_mask"].bool(), mask)
        assert torch.allclose(batch.batch["rollout_is_weights"][mask], torch.ones(int(mask.sum())), atol=1e-4)
        assert m["correction/masked_token_share"] == 0.0 and abs(m["correction/weight_mean"] - 1) < 1e-4
        assert np.isfinite(m["actor/pg_loss"]) and "actor/seq_ratio/mean" in m
