"""Recipes end to end on 2 CPU ranks with tiny models: each run commits.

1. DAPO (``recipe: dapo`` with overlong filtering) for one iteration, with a reward that gives
   every even-numbered prompt the same score: dynamic sampling drops those groups, runs more
   rounds, commits a full batch of groups whose scores differ, and the cursor moves past every
   prompt sampled. The same iteration again on a rolled-back copy, with a rank killed in
   ``generate_sequences``: the retried generate commits the same batch, bit for bit.
2. GSPO for one iteration (its sequence-ratio metrics reach the commit); then the same experiment
   with DAPO and a reward that never differs: the dynamic-sampling cap ends the run with its
   message, committing nothing.
3. Every other recipe (GRPO, Dr. GRPO, CISPO, RLOO, REINFORCE++) for one iteration each: it
   commits, its committed advantages equal the estimator's equation written here as a plain loop
   over the committed rewards, and its loss's own metrics reach the commit. (The losses' values
   and gradients against their papers' equations: tests/algos. GRPO's token-mean variant is
   GRPO with DAPO's token-mean aggregation, both run here; what it resolves to:
   tests/infra/config/test_recipes.py.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.runtime import faults
from tests.support.experiments import assert_same_commit, copy_experiment
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow

#: what every recipe run here shares: rule rewards off, no reward model, no KL reward, and
#: transformers generating on the actor's own module (``rollout.engine: hf``): the recipes' claims
#: are about advantages, losses and dynamic sampling, not the engine, and a group starts in about
#: half vLLM's time
GROUP_RUN = {
    "rollout.engine": "hf",
    "reward.rule": False,
    "reward.reward_model.enable": False,
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "reward.custom_function": "tests.support.rewards:odd_prompts_only",
}


def _scores_alike(table: DataProto) -> bool:
    """Whether some prompt group of ``table`` has all-equal scores (its token-level scores)."""
    scores = (table.batch["token_level_scores"] * table.batch["response_mask"]).sum(-1).tolist()
    uids = table.non_tensor_batch["uid"].tolist()
    groups: dict[str, set] = {}
    for uid, s in zip(uids, scores):
        groups.setdefault(uid, set()).add(round(s, 6))
    return any(len(v) == 1 for v in groups.values())


def test_dapo_drops_groups_fills_the_batch_and_a_killed_generate_commits_the_same(
    prefect_harness, flow_config, tmp_path, monkeypatch
):
    from ppoflow.flows.ppo import ppo

    over = {
        **GROUP_RUN,
        "recipe": "dapo",
        "algorithm.filter_overlong_responses": True,
        "reward.overlong_buffer.length": 4,
    }
    cfg = flow_config(str(tmp_path), "dapo", **over)
    assert cfg.algorithm.dynamic_sampling.enable and cfg.actor.clip_ratio_high == 0.28
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 1
    metrics = storage.read_json(paths.file(1, "metrics.json"))
    rounds = metrics["rollout/generation_rounds"]
    # every even-numbered prompt sampled scored all alike: at least their share was filtered
    sampled = [paths.file(1, "prompts.arrow")]
    sampled += [paths.file(1, f"prompts-r{r}.arrow") for r in range(1, int(rounds))]
    infos = [i for url in sampled for i in DataProto.load(url).non_tensor_batch["extra_info"]]
    evens = sum(info["index"] % 2 == 0 for info in infos) / len(infos)
    assert rounds >= 2 and evens > 0 and metrics["rollout/filtered_groups_share"] >= evens
    batch = DataProto.load(paths.file(1, "advantages.arrow"))
    assert len(batch) == 4 * 2 and len(set(batch.non_tensor_batch["uid"].tolist())) == 4
    indices = [info["index"] for info in batch.non_tensor_batch["extra_info"]]
    assert all(i % 2 == 1 for i in indices), indices
    # every prompt sampled moved the cursor: rounds x 4 prompts (12 per epoch)
    cursor = storage.read_json(paths.file(1, "manifest.json"))["data_cursor"]
    assert cursor["epoch"] * 12 + cursor["offset"] == 4 * rounds
    # overlong filtering: responses at the length limit get no loss; the penalty reached them
    rollout = DataProto.load(paths.file(1, "rollout.arrow"))
    full = (rollout.batch["response_mask"].sum(-1) >= cfg.rollout.response_length).numpy()
    assert metrics["response/truncated_share"] == pytest.approx(full.mean())
    assert np.all(batch.batch["response_mask"].sum(-1).numpy()[full] == 0)
    assert metrics["response/filtered_overlong"] == full.sum()
    # overlong shaping, DAPO's equation with L_max = 8, L_cache = 4
    lengths = rollout.batch["response_mask"].sum(-1).tolist()
    penalties = [-min(max(n - (8 - 4), 0) / 4, 1.0) for n in lengths]
    assert metrics["response/overlong_penalty_mean"] == pytest.approx(sum(penalties) / len(penalties))
    kept = batch.batch["response_mask"].reshape(-1, 4, batch.batch["response_mask"].shape[-1]).sum((1, 2))
    # a mini-batch (2 prompts x 2 responses) whose every response the filtering emptied takes no step
    assert metrics["actor/skipped_steps"] == float((kept == 0).sum())
    if bool((kept > 0).any()):
        assert {"actor/pg_clipfrac_low", "actor/pg_clipfrac_high"} <= set(metrics)
    else:
        assert "actor/pg_loss" not in metrics and "actor/grad_norm" not in metrics
    print(
        f"\ndapo: {rounds:.0f} rounds, {metrics['rollout/filtered_groups_share']:.2f} of groups dropped, "
        f"truncated share {metrics['response/truncated_share']:.2f}"
    )

    # the same iteration again, a rank killed when generation starts: the retry commits the same
    copy = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "dapo-killed", at=0)
    monkeypatch.setenv(faults.ENV_VAR, "rank_exit:generate_sequences:1")
    cfg_copy = flow_config(str(tmp_path), "dapo-killed", **over)
    state = ppo(cfg_copy, iterations=1, return_state=True)
    assert attempts(state)["generate"] == 2
    again = DataProto.load(ExperimentPaths(copy).file(1, "rollout.arrow"))
    assert again.non_tensor_batch["uid"].tolist() == rollout.non_tensor_batch["uid"].tolist()
    assert (again.batch["responses"] == rollout.batch["responses"]).all()
    assert_same_commit(cfg.storage.experiment_url, copy, 1, roles=("actor",))


def test_gspo_commits_and_dapo_without_signal_stops_at_the_cap(prefect_harness, flow_config, tmp_path):
    from ppoflow.flows.ppo import ppo

    root = str(tmp_path)
    cfg = flow_config(root, "chain", **GROUP_RUN, recipe="gspo")
    assert cfg.actor.policy_loss == "gspo" and cfg.actor.clip_ratio_high == 4e-4
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    m1 = storage.read_json(paths.file(1, "metrics.json"))
    assert {"actor/seq_ratio/mean", "actor/seq_ratio/max", "actor/pg_clipfrac_high"} <= set(m1)
    assert m1["actor/seq_ratio/min"] <= m1["actor/seq_ratio/mean"] <= m1["actor/seq_ratio/max"]

    over = {**GROUP_RUN, "reward.custom_function": "tests.support.rewards:always_half"}
    cfg = flow_config(root, "chain", **over, recipe="dapo", **{"algorithm.dynamic_sampling.max_rounds": 2})
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    message = str(state.result(raise_on_failure=False))
    assert "dynamic sampling: 2 generation rounds of iteration 2 found 0 of the 4 prompt groups" in message
    assert "(the other 8 scored all alike" in message and "algorithm.dynamic_sampling.max_rounds" in message
    assert read_manifest(paths).iteration == 1  # nothing committed


def _group_reference(scores: list[float], uids: list[str], estimator: str) -> list[float]:
    """Each response's outcome advantage from the papers' equations, a plain loop: GRPO
    ``(s - mean) / (std + 1e-6)`` (unbiased std), Dr. GRPO ``s - mean``, RLOO ``s - mean of the
    others``."""
    out = []
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if uids[j] == uids[i]]
        n, mean = len(group), sum(group) / len(group)
        if estimator == "rloo":
            out.append(s - (sum(group) - s) / (n - 1))
        elif estimator == "dr_grpo":
            out.append(s - mean)
        else:
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (n - 1))
            out.append((s - mean) / (std + 1e-6))
    return out


def _whitened_returns(rewards: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """REINFORCE++: each response token's return to go (gamma 1), whitened over every response
    token of the batch (unbiased variance)."""
    returns = []
    for r, m in zip(rewards, mask):
        g, row = 0.0, [0.0] * len(r)
        for t in reversed(range(len(r))):
            if m[t]:
                g += r[t]
                row[t] = g
        returns.append(row)
    flat = [x for row, m in zip(returns, mask) for x, keep in zip(row, m) if keep]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return [[(x - mean) / math.sqrt(var + 1e-8) if keep else 0.0 for x, keep in zip(row, m)]
            for row, m in zip(returns, mask)]  # fmt: skip


@pytest.mark.parametrize("recipe", ["grpo", "dr_grpo", "cispo", "rloo", "reinforce_plus_plus"])
def test_each_recipe_commits_with_its_equations(prefect_harness, flow_config, tmp_path, recipe):
    from ppoflow.flows.ppo import ppo

    over = {k: v for k, v in GROUP_RUN.items() if not k.startswith("algorithm.")}
    over["reward.custom_function"] = "tests.support.rewards:digit_share"
    cfg = flow_config(str(tmp_path), recipe, **over, recipe=recipe)
    assert ppo(cfg, iterations=1)["iteration"] == 1
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 1
    metrics = storage.read_json(paths.file(1, "metrics.json"))
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    assert not any(k.startswith("critic/vf_") for k in metrics)  # no critic in any of these

    batch = DataProto.load(paths.file(1, "advantages.arrow"))
    mask = batch.batch["response_mask"].tolist()
    rewards = batch.batch["token_level_rewards"].tolist()
    got = batch.batch["advantages"].tolist()
    if recipe == "reinforce_plus_plus":
        want = _whitened_returns(rewards, mask)
    else:
        scores = [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards, mask)]
        uids = batch.non_tensor_batch["uid"].tolist()
        per = _group_reference(scores, uids, {"rloo": "rloo", "dr_grpo": "dr_grpo"}.get(recipe, "grpo"))
        want = [[a if keep else 0.0 for keep in m] for a, m in zip(per, mask)]
        assert len(set(round(s, 6) for s in scores)) > 1, "the reward gave no signal: nothing is compared"
    assert np.allclose(np.array(got), np.array(want), atol=1e-5), (recipe, got, want)

    if recipe == "grpo":
        assert "actor/kl_loss" in metrics  # GRPO's KL is a loss term, not a reward penalty
    else:
        assert "actor/kl_loss" not in metrics
    if recipe == "cispo":
        assert cfg.actor.policy_loss == "cispo" and cfg.actor.clip_ratio_low == 1.0
        assert metrics["actor/pg_clipfrac_low"] == 0.0  # no lower bound: no weight is clipped below
    assert {"actor/pg_clipfrac_low", "actor/pg_clipfrac_high", "actor/pg_loss"} <= set(metrics)
