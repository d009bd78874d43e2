"""On-policy distillation in the real flow (2 CPU ranks, tiny models; transformers generates on the
actor's own module, ``rollout.engine: hf``: the claims are about the teacher's step, the advantage
and resuming, not the engine). The student is the flow tests' tiny policy, the teacher another
tiny model with its tokenizer; ``recipe: distill`` with a discount (gamma 0.5) and a coefficient
(2) that are not the defaults, snapshots every 2 iterations:

- two iterations commit; iteration 1's ``teacher_log_prob.arrow`` holds the teacher's log-probs of
  the sampled tokens (a plain transformers forward of the teacher model), and its advantages equal
  the discounted return of ``2 x (teacher - student)`` written here as a loop over the stored
  columns; ``distill/reverse_kl`` is their mean distance;
- a copy rolled back to iteration 1 (whose state was never written: a new flow run's group, its
  teacher built again, rebuilds it from snapshot 0 by replaying update 1) runs iteration 2 again,
  the teacher's task failing once (Prefect retries it), and commits bit for bit what the
  uninterrupted run committed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.experiments import assert_same_commit, copy_experiment
from tests.support.hf_log_probs import response_log_probs
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow

COEF, GAMMA = 2.0, 0.5


def _distill(teacher: str) -> dict:
    return {
        "recipe": "distill",
        "teacher.model.path": teacher,
        "teacher.log_prob_micro_batch_size_per_gpu": 3,
        "algorithm.distill.coef": COEF,
        "algorithm.distill.gamma": GAMMA,
        "rollout.engine": "hf",
        "reward.rule": False,  # the teacher alone, as the recipe means it
        "reward.reward_model.enable": False,
        "checkpoint.snapshot_every": 2,
        "checkpoint.snapshot_at_end": False,
    }


def _hand_advantages(batch: DataProto) -> list[list[float]]:
    """Each response token's return to go of ``COEF x (teacher - student)``, discounted by GAMMA
    over the response mask's tokens, in plain Python."""
    out = []
    cols = ("old_log_probs", "teacher_log_prob", "response_mask")
    for student, teacher, mask in zip(*(batch.batch[k].tolist() for k in cols)):
        g, row = 0.0, [0.0] * len(mask)
        for t in reversed(range(len(mask))):
            if mask[t]:
                g = COEF * (teacher[t] - student[t]) + GAMMA * g
                row[t] = g
        out.append(row)
    return out


def test_distillation_commits_its_advantage_and_resumes_between_snapshots_exactly(
    prefect_harness, flow_config, tmp_path, monkeypatch
):
    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.runtime import faults

    t0 = time.perf_counter()
    teacher = save_tiny_model(str(tmp_path / "teacher"), seed=3)
    cfg = flow_config(str(tmp_path), "straight", **_distill(teacher))
    assert cfg.algorithm.adv_estimator == "distill" and not cfg.critic.enable
    ppo(cfg, iterations=2)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 2
    t_run = time.perf_counter() - t0

    # the teacher's step: its own file, the teacher model's log-probs of the sampled tokens
    rollout = DataProto.load(paths.file(1, "rollout.arrow"))
    scored = DataProto.load(paths.file(1, "teacher_log_prob.arrow"))
    mask = rollout.batch["response_mask"].bool()
    want = response_log_probs(teacher, rollout, cfg.rollout.temperature)
    err = (scored.batch["teacher_log_prob"] - want)[mask].abs().max().item()
    assert err < 1e-5, err
    assert (scored.batch["teacher_log_prob"][~mask] == 0).all()
    student = response_log_probs(cfg.model.path, rollout, cfg.rollout.temperature)
    assert (student - want)[mask].abs().max().item() > 0.1  # another model than the student

    # the advantage from the stored columns, by hand
    batch = DataProto.load(paths.file(1, "advantages.arrow"))
    assert torch.equal(batch.batch["teacher_log_prob"], scored.batch["teacher_log_prob"])
    got = batch.batch["advantages"].tolist()
    hand = _hand_advantages(batch)
    assert max(abs(a - b) for ra, rb in zip(got, hand) for a, b in zip(ra, rb)) < 1e-5
    assert (batch.batch["token_level_scores"] == 0).all()  # no task reward: the teacher's alone
    metrics = storage.read_json(paths.file(1, "metrics.json"))
    m = batch.batch["response_mask"]
    distance = ((batch.batch["old_log_probs"] - batch.batch["teacher_log_prob"]) * m).sum() / m.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(distance.item(), rel=1e-5)
    assert not os.path.exists(paths.checkpoint("actor", 1))  # between snapshots: never written

    # iteration 2 again on a copy rolled back to 1: state 1 replayed, the teacher's task retried
    t1 = time.perf_counter()
    copy = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "resumed", at=1)
    monkeypatch.setenv(faults.ENV_VAR, "task:teacher_log_prob:before")
    state = ppo(flow_config(str(tmp_path), "resumed", **_distill(teacher)), iterations=1, return_state=True)
    assert state.is_completed()
    assert attempts(state)["teacher_log_prob"] == 2
    m2 = storage.read_json(ExperimentPaths(copy).file(2, "metrics.json"))
    assert m2["replay/actor_updates"] == 1  # state 1 was rebuilt from snapshot 0 + update 1
    assert_same_commit(cfg.storage.experiment_url, copy, 2, roles=("actor",))
    print(
        f"\ndistill: teacher log-prob err {err:.1e}; two iterations {t_run:.1f} s, the resumed "
        f"iteration {time.perf_counter() - t1:.1f} s"
    )
