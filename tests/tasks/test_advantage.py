"""ppoflow.tasks.advantage: the KL controller continues from the manifest's coefficient, and the
token-level scores are the reward model's, the rule's and DAPO's overlong penalty on the last
response token (checked against a plain loop over rows)."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.config import apply_overrides, parse_config
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.rewards import register_reward
from ppoflow.tasks.advantage import _token_level_scores, kl_controller

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["d.parquet"], "train_batch_size": 4},
    "rollout": {"response_length": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
}


def _cfg(**over):
    return parse_config(apply_overrides(dict(BASE), over), source="advantage test")


def test_an_adaptive_controller_continues_from_the_manifest_and_a_fixed_one_does_not():
    adaptive = _cfg(**{"algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05})
    assert kl_controller(adaptive, None).value == 0.05
    assert kl_controller(adaptive, 0.3).value == 0.3
    fixed = _cfg(**{"algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.05})
    assert kl_controller(fixed, 0.3).value == 0.05


@register_reward("tests/exact-answer", override=True)
def _exact(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(solution_str == ground_truth)


class _Chars:
    """A tokenizer of single characters (ids are code points)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_token_level_scores_sit_on_each_rows_last_response_token():
    cfg = _cfg(
        **{"reward.rm_weight": 0.5, "reward.overlong_buffer.enable": True, "reward.overlong_buffer.length": 2}
    )
    answers = ["12", "7", "", "4242"]
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    responses = torch.zeros(4, 4, dtype=torch.long)
    for i, text in enumerate(answers):
        responses[i, : len(text)] = torch.tensor([ord(c) for c in text], dtype=torch.long)
    rm = torch.zeros(4, 4)
    rm[0, 1], rm[3, 3] = 2.0, -1.0
    batch = DataProto.from_dict(
        {"responses": responses, "response_mask": mask, "rm_scores": rm},
        {
            "data_source": np.asarray(["tests/exact-answer"] * 4, dtype=object),
            "ground_truth": np.asarray(["12", "8", "0", "4242"], dtype=object),
        },
    )
    scores = _token_level_scores(cfg, batch, _Chars())
    expected = torch.zeros(4, 4)
    for i, text in enumerate(answers):
        last = max((j for j in range(4) if mask[i, j]), default=0)
        rule = 1.0 if text == batch.non_tensor_batch["ground_truth"][i] else 0.0
        length = int(mask[i].sum())
        # DAPO: no penalty up to max - buffer tokens, then linear to -factor at the max
        overlong = min(0.0, (4 - 2 - length) / 2 * cfg.reward.overlong_buffer.penalty_factor)
        expected[i, last] += 0.5 * rm[i].sum() + rule + overlong
    torch.testing.assert_close(scores, expected)


def test_a_teachers_reward_enters_with_the_distill_estimator_only():
    """With ``adv_estimator: distill`` the rewards are ``coef x (teacher - student)`` per response
    token (a task's score is measured, not trained on) and the discount is
    ``algorithm.distill.gamma``; with the teacher as a loss term (GRPO) the rewards are the task's;
    either way the student's distance from the teacher is measured."""
    from ppoflow.tasks.advantage import _with_teacher

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    student = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, -9.0], [-0.5, -9.0, -9.0]])
    batch = DataProto.from_dict(
        {"response_mask": mask, "old_log_probs": student, "teacher_log_prob": teacher}
    )
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # a task's score on a last token
    over = {"teacher.model.path": "t", "algorithm.distill.coef": 2.0, "algorithm.distill.gamma": 0.5}
    distill = _cfg(**{"recipe": "distill", **over})
    metrics: dict[str, float] = {}
    penalty = torch.tensor([[-0.25, -0.25, 0.0], [-0.25, 0.0, 0.0]])  # a KL penalty in the reward, say
    rewards, gamma = _with_teacher(distill, batch, scores, scores + penalty, metrics)
    assert gamma == 0.5
    # 2 x (t - s), and the penalty; the task's score left out
    assert rewards.tolist() == [[1.0 - 0.25, -2.0 - 0.25, 0.0], [0.0 - 0.25, 0.0, 0.0]]
    assert abs(metrics["distill/reverse_kl"] - (-0.5 + 1.0 + 0.0) / 3) < 1e-7  # mean of s - t, 3 tokens
    loss_term = _cfg(**{"recipe": "distill+rl", "rollout.n": 2, **over})
    rewards, gamma = _with_teacher(loss_term, batch, scores, scores, metrics := {})
    assert gamma == loss_term.algorithm.gamma and torch.equal(rewards, scores)
    assert abs(metrics["distill/reverse_kl"] - (-0.5 + 1.0 + 0.0) / 3) < 1e-7
