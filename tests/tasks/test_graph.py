"""ppoflow.tasks.graph: the iteration's table of steps, and everything derived from it — which
steps run for each recipe, the worker groups an unfinished iteration needs, the roles with
checkpoints, the critical path, the picture the docs show, and the keyword arguments each row
gives its task."""

from __future__ import annotations

import copy
import os

import pytest

from ppoflow.infra.config import apply_overrides, parse_config
from ppoflow.tasks import TASKS
from ppoflow.tasks.graph import (
    STEP,
    STEPS,
    StepSpec,
    WiringError,
    critical_path,
    pending_roles,
    picture,
    steps,
    trained_roles,
    writers,
)
from tests.support.paths import ROOT

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["d.parquet"], "train_batch_size": 4},
    "rollout": {"n": 4},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
}

# what each setting must run, written from what the algorithms need (not from the table):
# (overrides, steps of the data and update phases, trained roles, groups of a fresh iteration)
RECIPES = {
    "ppo with a critic and KL in the reward": (
        {"recipe": "ppo", "algorithm.use_kl_in_reward": True},
        ["generate", "ref_log_prob", "values", "advantage", "update_actor", "update_critic"],
        ["actor", "critic"],
        ["actor", "critic"],
    ),
    "grpo (KL as a loss, no critic)": (
        {"recipe": "grpo"},
        ["generate", "ref_log_prob", "advantage", "update_actor"],
        ["actor"],
        ["actor"],
    ),
    "dr_grpo (no KL, no critic)": (
        {"recipe": "dr_grpo"},
        ["generate", "advantage", "update_actor"],
        ["actor"],
        ["actor"],
    ),
    "a reward model": (
        {"recipe": "grpo", "reward.reward_model.enable": True, "reward.reward_model.model.path": "rm"},
        ["generate", "ref_log_prob", "rm_score", "advantage", "update_actor"],
        ["actor"],
        ["actor", "reward_model"],
    ),
    "multi-turn with a tool": (
        {"recipe": "grpo", "rollout.multi_turn.enable": True, "actor.use_kl_loss": False},
        ["generate", "advantage", "update_actor"],
        ["actor"],
        ["actor"],
    ),
    "asynchronous training (GRPO with KL as a loss)": (
        {"recipe": "grpo", "asynchronous.enable": True},
        ["consume", "old_log_prob", "ref_log_prob", "advantage", "update_actor", "publish_policy"],
        ["actor"],
        ["actor"],
    ),
    "on-policy distillation (the teacher's reward alone)": (
        {"recipe": "distill", "teacher.model.path": "t"},
        ["generate", "teacher_log_prob", "advantage", "update_actor"],
        ["actor"],
        ["actor"],
    ),
    "GRPO with the teacher's KL as a loss, asynchronous": (
        {"recipe": "distill+rl", "teacher.model.path": "t", "asynchronous.enable": True},
        ["consume", "old_log_prob", "teacher_log_prob", "advantage", "update_actor", "publish_policy"],
        ["actor"],
        ["actor"],
    ),
    "LoRA on actor and critic": (
        {"recipe": "ppo", "actor.lora.rank": 8, "critic.lora.rank": 8, "algorithm.use_kl_in_reward": False},
        ["generate", "values", "advantage", "update_actor", "update_critic"],
        ["actor", "critic"],
        ["actor", "critic"],
    ),
}


def _config(over: dict):
    data = copy.deepcopy(BASE)  # apply_overrides writes into the nested sections
    if "recipe" in over:
        data["recipe"] = over["recipe"]
        over = {k: v for k, v in over.items() if k != "recipe"}
    return parse_config(apply_overrides(data, over), source="graph test")


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_runs_the_steps_it_needs(name):
    over, expected, trained, fresh = RECIPES[name]
    cfg = _config(over)
    assert [s.name for s in steps(cfg, ("rollout", "score", "update", "publish"))] == expected
    assert trained_roles(cfg) == trained
    assert pending_roles(cfg, lambda step: True) == fresh
    # every step that runs reads only steps that run before it (gathers: those that run)
    ran: set[str] = set()
    for spec in steps(cfg):
        assert set(spec.reads) <= ran, (spec.name, spec.reads)
        ran |= {spec.name, spec.provides} - {None}
    # with everything of the data side done, only the groups of the missing updates are needed
    done = {"generate", "consume", "old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score"}
    done |= {"advantage"}
    assert pending_roles(cfg, lambda step: step not in done) == trained


def test_the_groups_an_unfinished_iteration_still_needs():
    cfg = _config(RECIPES["a reward model"][0])
    # generate and the reward model's score are done; the reference's log-probs are not
    left = {"ref_log_prob", "advantage", "update_actor"}
    assert pending_roles(cfg, lambda step: step in left) == ["actor"]
    left = {"rm_score"}
    assert pending_roles(cfg, lambda step: step in left) == ["reward_model"]
    assert pending_roles(cfg, lambda step: False) == []


def test_every_step_has_its_task_and_the_critical_path_covers_every_step():
    assert set(TASKS) == {s.name for s in STEPS}
    for name, task in TASKS.items():
        assert task.name == name
    stages = critical_path()
    assert [name for stage in stages for name in stage] == [s.name for s in STEPS]
    assert stages[0] == ("generate", "consume") and stages[-1] == ("commit",)
    assert ("old_log_prob", "ref_log_prob", "teacher_log_prob", "values", "rm_score") in stages
    assert ("update_actor", "update_critic") in stages
    # the outputs later steps read are named by the table; consume stands in for generate
    assert {STEP[r].output for r in STEP["advantage"].gathers} == {
        "old_log_prob",
        "ref_log_prob",
        "teacher_log_prob",
        "values",
        "rm_score",
    }
    assert STEP["consume"].provides == "generate" and STEP["consume"].output == STEP["generate"].output
    assert writers("rollout") == ("generate", "consume") and writers("advantages") == ("advantage",)


def test_a_row_gives_its_task_keyword_arguments_by_the_names_it_wires():
    """What the schedule passes: the receipts of the steps a row reads (a stand-in's under the name
    it provides), one list of those it gathers that ran, the start's fields it names, its options."""

    class Start:  # the fields a row's state may name (flows.schedule.Start's)
        actor, critic, rollout_actor, rollout_critic = "a/1", "c/1", "a/0", "c/0"
        cursor, kl_coef = {"epoch": 0, "offset": 8}, 0.2

    ran = {"generate": "R", "ref_log_prob": "REF", "values": "V"}
    assert STEP["advantage"].arguments(ran, Start, {}) == {
        "generate": "R",
        "gathered": ["REF", "V"],  # table order, only those that ran
        "kl_coef": 0.2,
    }
    assert STEP["values"].arguments(ran, Start, {}) == {"generate": "R", "rollout_critic": "c/0"}
    assert STEP["generate"].arguments({}, Start, {}) == {"rollout_actor": "a/0", "cursor": Start.cursor}
    given = {"snapshot": True, "final": False}
    assert STEP["update_critic"].arguments({"advantage": "A"}, Start, given) == {
        "advantage": "A",
        "critic": "c/1",
        "snapshot": True,
        "final": False,
    }
    assert STEP["evaluate"].arguments({}, Start, given) == {"actor": "a/1"}
    # at a run's start publish_policy reads the actor the run starts from in place of update_actor
    assert STEP["publish_policy"].opening_arguments(Start) == {"update_actor": "a/1"}
    with pytest.raises(WiringError, match="at_start"):
        STEP["generate"].opening_arguments(Start)


def test_rows_are_built_by_keyword_and_frozen():
    with pytest.raises(TypeError):
        StepSpec("probe", 0, "score")
    row = StepSpec(name="probe", stage=0, phase="score")
    with pytest.raises(AttributeError):
        row.stage = 1
    assert row.runs(_config({})) and row.parameters == () and row.roles == ()


def test_the_docs_show_the_tables_picture():
    text = picture()
    for step in STEPS:
        assert step.name in text
    for page in ("README.md", os.path.join("docs", "internals.md")):
        with open(os.path.join(ROOT, page)) as f:
            assert text in f.read(), f"{page} does not show ppoflow.tasks.graph.picture(); paste it"


@pytest.mark.parametrize(
    "over, role",
    [
        ({"recipe": "ppo", "algorithm.use_kl_in_reward": True}, "actor_rollout_ref"),
        ({"recipe": "dr_grpo"}, "actor_rollout"),  # no KL term: no frozen copy of the model
        ({"algorithm.adv_estimator": "grpo"}, "actor_rollout"),  # a veRL user's GRPO: no critic, no ref
        ({"recipe": "grpo"}, "actor_rollout_ref"),  # KL as a loss
        ({"recipe": "grpo", "asynchronous.enable": True}, "actor_ref"),  # the producer samples
        ({"recipe": "dr_grpo", "asynchronous.enable": True}, "actor"),
        (
            {"recipe": "dr_grpo", "asynchronous.enable": True, "data.val_files": ["v.parquet"]},
            "actor_rollout",
        ),
        # a teacher is a flag on any role: the teacher_log_prob step runs on the actor group
        ({"recipe": "distill", "teacher.model.path": "t"}, "actor_rollout+teacher"),
        (
            {"recipe": "distill+rl", "teacher.model.path": "t", "actor.use_kl_loss": True},
            "actor_rollout_ref+teacher",
        ),
        ({"recipe": "distill", "teacher.model.path": "t", "asynchronous.enable": True}, "actor+teacher"),
    ],
)
def test_the_actor_group_builds_an_engine_and_a_reference_only_where_a_step_uses_them(over, role):
    from ppoflow.tasks.graph import actor_group_role

    cfg = _config(over)
    assert actor_group_role(cfg) == role
    assert cfg.critic.enable is (cfg.algorithm.adv_estimator == "gae")  # the critic follows the estimator
