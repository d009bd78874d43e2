"""ppoflow.infra.config.teacher: the teacher section, ``algorithm.distill``, the two distillation
recipes, and the checks of a teacher against what reads it."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ConfigError, ExperimentConfig, parse_config

BASE = {"model": {"path": "m"}, "data": {"train_files": ["d.parquet"]}, "rollout": {"n": 2}}
TEACHER = {"model": {"path": "t"}}


def test_the_distill_recipe_is_the_teachers_reward_alone():
    cfg = parse_config({**BASE, "recipe": "distill", "teacher": TEACHER})
    assert cfg.algorithm.adv_estimator == "distill"
    assert (cfg.algorithm.distill.coef, cfg.algorithm.distill.gamma) == (1.0, 0.0)
    # no task reward, no critic, no reference: the teacher is the only other model
    assert not cfg.reward.rule and not cfg.critic.enable
    assert not cfg.actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert cfg.actor.teacher_kl_coef == 0.0
    assert ExperimentConfig.model_validate(cfg.model_dump(mode="json")) == cfg


def test_distill_plus_rl_is_grpo_with_the_teachers_kl_as_a_loss_term():
    cfg = parse_config({**BASE, "recipe": "distill+rl", "teacher": TEACHER})
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.reward.rule and not cfg.critic.enable
    assert cfg.actor.teacher_kl_coef == 1.0 and cfg.actor.teacher_kl_type == "k2"
    assert not cfg.actor.use_kl_loss  # the teacher's KL takes the reference's place
    own = parse_config(
        {**BASE, "recipe": "distill+rl", "teacher": TEACHER, "actor": {"teacher_kl_coef": 0.1}}
    )
    assert own.actor.teacher_kl_coef == 0.1


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"recipe": "distill"}, "algorithm.adv_estimator='distill' rewards the student by a teacher"),
        ({"actor": {"teacher_kl_coef": 0.5}}, "actor.teacher_kl_coef=0.5 is a KL to a teacher"),
        ({"teacher": TEACHER}, "teacher is set, but nothing reads its log-probs"),
        (
            {
                "recipe": "distill",
                "teacher": {**TEACHER, "fsdp": {"fsdp_size": 3}},
                "resources": {"nprocs": 2},
            },
            "teacher.fsdp.fsdp_size=3 must be -1 or a divisor of resources.nprocs=2",
        ),
        (
            {"recipe": "distill", "teacher": {**TEACHER, "log_prob_max_token_len_per_gpu": 50}},
            "teacher.log_prob_max_token_len_per_gpu=50 is smaller than the longest row",
        ),
        ({"recipe": "distill", "teacher": TEACHER, "algorithm": {"distill": {"gamma": 1.5}}}, "gamma"),
        ({"recipe": "distill", "teacher": TEACHER, "algorithm": {"distill": {"coef": 0}}}, "coef"),
    ],
)
def test_a_teacher_and_what_reads_it_are_checked_together(data, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        parse_config({**BASE, **data})


def test_a_teacher_is_a_reward_source_and_its_defaults_follow_the_device():
    bare = {**BASE, "reward": {"rule": False}}
    with pytest.raises(ConfigError, match="no reward source"):
        parse_config(bare)
    cfg = parse_config({**bare, "algorithm": {"adv_estimator": "distill"}, "teacher": TEACHER})
    assert cfg.teacher is not None and cfg.teacher.fsdp.param_dtype is None
    assert cfg.teacher.model.use_torch_compile is False
    gpu = parse_config(
        {
            **bare,
            "algorithm": {"adv_estimator": "distill"},
            "teacher": TEACHER,
            "resources": {"device": "cuda", "nprocs": 1},
        }
    )
    assert gpu.teacher is not None
    assert gpu.teacher.fsdp.param_dtype == "bfloat16" and gpu.teacher.model.use_torch_compile is True
