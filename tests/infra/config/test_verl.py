"""veRL's command line translated onto ppoflow's config (``ppoflow.infra.config.verl``): the four
recorded veRL commands (tests/data/verl_commands/), veRL's defaults, Hydra's syntax, refusals,
the rollout correction, DAPO's settings, and the catalogue against docs/verl.md."""

from __future__ import annotations

import os
import re

import pytest

from ppoflow.infra.config import ConfigError, parse_config
from ppoflow.infra.config.correction import RolloutCorrectionConfig
from ppoflow.infra.config.loading import with_verl
from ppoflow.infra.config.verl import VerlError, translate
from ppoflow.infra.config.verl.algorithm import UNBOUNDED_ROUNDS, rejection_bounds
from ppoflow.infra.config.verl.keys import CHECKED, IGNORED, MAPPED
from ppoflow.infra.config.verl.run import NEVER
from tests.support.paths import ROOT

COMMANDS = os.path.join(ROOT, "tests", "data", "verl_commands")
NAMES = sorted(n.removesuffix(".txt") for n in os.listdir(COMMANDS) if n.endswith(".txt"))
A, R, RC = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm.rollout_correction"
#: what a command needs besides what it is about (veRL's defaults name files and a model that
#: exist only on veRL's machines; the config is parsed on a machine without a GPU)
BASE = ["actor_rollout_ref.model.path=m", "data.train_files=t.parquet", "~data.val_files"]


def command(name: str) -> list[str]:
    """The overrides of a recorded veRL command, one per line (comment lines skipped)."""
    with open(os.path.join(COMMANDS, name + ".txt")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def config(*items: str):
    t = translate([*BASE, *items])
    t.check()
    return parse_config(t.config, source="a veRL command")


@pytest.mark.parametrize("name", NAMES)
def test_every_key_of_a_recorded_command_is_mapped_ignored_or_refused(name):
    items = command(name)
    t = translate(items)
    keys = [i.lstrip("+~").partition("=")[0] for i in items]
    mapped, ignored, refused = set(t.mapped), set(t.ignored), set(t.refused)
    assert not (mapped & ignored or mapped & refused or ignored & refused)
    assert mapped | ignored | refused == set(keys) == set(t.keys)
    assert all(t.ignored[k] for k in ignored) and all(t.mapped[k] for k in mapped)
    assert len(NAMES) == 4 and all(
        "b178a3cd" in open(os.path.join(COMMANDS, n + ".txt")).readline() for n in NAMES
    )


def test_the_quickstart_is_ppo_with_a_critic_at_its_batch_sizes():
    t = translate(command("quickstart_ppo_gsm8k"))
    t.check()
    cfg = parse_config(t.config)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size) == (
        256,
        64,
        64,
    )
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length) == (512, 512)
    assert cfg.algorithm.kl_ctrl.type == "fixed" and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert not cfg.algorithm.use_kl_in_reward and not cfg.actor.use_kl_loss
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr) == (1e-6, 1e-5)
    assert cfg.critic.model is not None and cfg.critic.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg.rollout.engine == "vllm" and cfg.rollout.n == 1 and cfg.resources.nprocs == 1
    assert (cfg.evaluation.every, cfg.evaluation.at_end, cfg.evaluation.before_training) == (10, True, False)
    assert cfg.checkpoint.snapshot_every == 10 and cfg.data.truncation == "error"
    assert (cfg.storage.root, cfg.storage.experiment) == ("checkpoints/verl_examples", "gsm8k")
    assert cfg.data.train_files == [os.path.expanduser("~/data/gsm8k/train.parquet")]
    assert (t.epochs, t.steps) == (15, None)
    assert (
        "trainer.logger" in t.ignored and "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in t.ignored
    )


def test_grpo_samples_five_with_a_kl_loss_and_no_critic():
    t = translate(command("grpo_qwen2_7b"))
    t.check()
    cfg = parse_config(t.config)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.critic.enable is False
    assert cfg.rollout.n == 5 and cfg.rollout.tensor_model_parallel_size == 2 and cfg.resources.nprocs == 8
    assert (
        cfg.actor.use_kl_loss and cfg.actor.kl_loss_type == "low_var_kl" and cfg.actor.kl_loss_coef == 0.001
    )
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.rollout.response_length) == (
        1024,
        256,
        1024,
    )
    assert cfg.data.filter_overlong_prompts and cfg.ref.fsdp.param_offload
    assert cfg.model.enable_gradient_checkpointing and cfg.evaluation.every == 5
    assert cfg.storage.root == "checkpoints/verl_grpo_example_gsm8k"
    assert cfg.storage.experiment == "qwen2_7b_function_rm"
    assert "actor_rollout_ref.model.use_remove_padding" in t.ignored


def test_lora_has_its_rank_and_alpha():
    t = translate(command("grpo_lora_qwen2_5_3b"))
    t.check()
    cfg = parse_config(t.config)
    assert (cfg.actor.lora.rank, cfg.actor.lora.alpha, cfg.actor.lora.target_modules) == (
        64,
        32.0,
        "all-linear",
    )
    assert cfg.actor.optim.lr == 3e-6 and cfg.data.shuffle is False and cfg.data.train_batch_size == 16
    assert cfg.storage.experiment == "qwen2.5_3b_grpo_lora" and not cfg.evaluation.before_training
    assert "actor_rollout_ref.rollout.load_format" in t.ignored


def test_dapo_has_its_clip_sampling_and_buffer_once_its_filter_compares_the_score():
    """The recorded command filters groups on ``seq_reward``, which holds the overlong penalty:
    ppoflow's dynamic sampling compares the score before shaping, so that one key is refused;
    with ``metric=acc`` (DAPO's paper) the rest translates."""
    t = translate(command("dapo_e2e"))
    assert set(t.refused) == {"algorithm.filter_groups.metric"}
    assert "seq_reward" in t.refused["algorithm.filter_groups.metric"]
    with pytest.raises(VerlError, match="algorithm.filter_groups.metric"):
        t.check()
    t = translate(command("dapo_e2e") + ["algorithm.filter_groups.metric=acc"])
    t.check()
    cfg = parse_config(t.config)
    assert (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.2, 0.28)
    assert (
        cfg.algorithm.dynamic_sampling.enable
        and cfg.algorithm.dynamic_sampling.max_rounds == 10 * 1024 // 256
    )
    ob = cfg.reward.overlong_buffer
    assert ob.enable and ob.length == 128 and ob.penalty_factor == 1.0
    assert cfg.actor.loss_agg_mode == "token-mean" and not cfg.actor.use_kl_loss and cfg.rollout.n == 4
    assert cfg.checkpoint.snapshot_every == NEVER and cfg.checkpoint.snapshot_at_end
    assert (t.steps, t.resume_mode) == (1, "disable") and "trainer.total_epochs" in t.ignored
    assert cfg.storage.experiment == "qwen2.5-0.5b-instruct-dapo-minimal"


def test_keys_not_given_take_verls_defaults_where_they_change_training():
    cfg = config()
    assert (cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size) == (
        1024,
        256,
        256,
    )
    assert (cfg.rollout.prompt_length, cfg.rollout.response_length, cfg.rollout.n) == (512, 512, 1)
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr, cfg.rollout.temperature) == (1e-6, 1e-5, 1.0)
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable
    assert (cfg.algorithm.kl_ctrl.type, cfg.algorithm.kl_ctrl.kl_coef, cfg.algorithm.use_kl_in_reward) == (
        "fixed",
        0.001,
        False,
    )
    assert cfg.evaluation.before_training and cfg.evaluation.every == 0 and not cfg.evaluation.at_end
    assert cfg.evaluation.temperature == 0.0 and cfg.data.truncation == "error"
    # ... and ppoflow's where they change only speed: packed micro-batches, token budgets
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 16384
    assert (cfg.storage.root, cfg.storage.experiment) == ("checkpoints/verl_examples", "gsm8k")
    assert translate(BASE).epochs == 30
    gpu = config("trainer.device=cuda")  # bf16 compute and a bf16 engine on GPU, as veRL's
    assert gpu.actor.fsdp.param_dtype == "bfloat16" and gpu.rollout.dtype == "bfloat16"
    assert gpu.model.dtype == "float32"


def test_refusals_are_one_error_naming_every_refused_key():
    items = [
        f"{A}.strategy=megatron",
        f"{R}.name=sglang",
        "algorithm.adv_estimator=remax",
        "trainer.nnodes=2",
        "trainer.critic_warmup=3",
        f"{A}.policy_loss.loss_mode=clip_cov",
        f"{A}.optim.lr_warmup_steps=10",
        f"{A}.optim.lr=3e-6",  # fine
    ]
    t = translate([*BASE, *items])
    assert set(t.refused) == {i.partition("=")[0] for i in items[:-1]}
    with pytest.raises(VerlError) as err:
        t.check()
    text = str(err.value)
    assert all(i.partition("=")[0] in text for i in items[:-1]) and "nothing was started" in text
    assert "docs/multinode.md" in text and "FSDP2" in text and "gae" in text
    assert f"{A}.optim.lr" in t.mapped


def test_unknown_keys_are_refused_naming_the_nearest():
    t = translate([*BASE, f"{A}.ppo_mini_batchsize=4", "trainer.loger=console", "actor.ppo_epochs=2"])
    assert t.refused[f"{A}.ppo_mini_batchsize"] == f"not a veRL key; the nearest is {A}.ppo_mini_batch_size"
    assert t.refused["trainer.loger"].endswith("trainer.logger")
    assert t.refused["actor.ppo_epochs"].endswith(f"{A}.ppo_epochs")


def test_hydra_syntax_add_delete_values_and_last_wins():
    t = translate(
        [
            *BASE,
            "+actor_rollout_ref.rollout.n=4",
            "++data.train_batch_size=8",
            f"{A}.ppo_mini_batch_size=8",
            f"{A}.ppo_mini_batch_size=4",
            "trainer.logger=['console','wandb']",
            f"{A}.use_kl_loss=True",
            f"{A}.optim.lr=2e-6",
            "critic.enable=null",
            "data.train_files=[a.parquet,b.parquet]",
            "trainer.total_training_steps=7",
            "~trainer.total_training_steps",
            "algorithm.adv_estimator=grpo",
        ]
    )
    t.check()
    cfg = parse_config(t.config)
    assert cfg.rollout.n == 4 and cfg.data.train_batch_size == 8 and cfg.actor.ppo_mini_batch_size == 4
    assert cfg.actor.use_kl_loss is True and cfg.actor.optim.lr == 2e-6
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and cfg.data.val_files == []
    assert cfg.critic.enable is False  # null: left to ppoflow, off for grpo
    assert "critic.enable" in t.ignored and "trainer.logger" in t.mapped
    assert cfg.tracking.wandb is not None and cfg.tracking.wandb.project == "verl_examples"
    assert cfg.tracking.wandb.name == "gsm8k"  # veRL's run, under its project and experiment names
    console = translate([*BASE, "trainer.logger=console"])
    assert "trainer.logger" in console.ignored and "tracking" not in console.config
    assert t.steps is None and "deleted" in t.ignored["trainer.total_training_steps"]
    assert "deleted" in t.ignored["data.val_files"]
    t = translate(["data.val_files=v.parquet", "not-an-override", "config.yaml"])
    assert "KEY=VALUE" in t.refused["not-an-override"] and "before --verl" in t.refused["config.yaml"]


def test_rollout_correction_maps_tis_and_the_k1_rejections():
    cfg = config(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.5")
    assert (cfg.algorithm.rollout_correction.tis, cfg.algorithm.rollout_correction.tis_cap) == ("token", 2.5)
    # veRL keeps -log r in [log lower, log upper]: r = pi_old / pi_sampler in [1/upper, 1/lower]
    assert rejection_bounds("0.8_1.6") == pytest.approx((0.625, 1.25))
    assert rejection_bounds(2.0) == pytest.approx((0.5, 2.0))
    for option, level in (("token_k1", "token"), ("seq_sum_k1", "sequence"), ("seq_mean_k1", "geometric")):
        t = translate([*BASE, f"{RC}.rollout_rs={option}", f"{RC}.rollout_rs_threshold=1.001"])
        t.check()
        rc = t.config["algorithm"]["rollout_correction"]
        assert rc["mis"] == level and rc["mis_lower"] == pytest.approx(1 / 1.001) and rc["mis_upper"] == 1.001
        assert rc["mis_normaliser"] == "kept"  # veRL drops rejected tokens from the loss's normaliser
    bad = translate(
        [*BASE, f"{RC}.rollout_rs=token_k1,seq_max_k2", f"{RC}.rollout_is=token", f"{RC}.loss_type=reinforce"]
    )
    assert "several criteria" in bad.refused[f"{RC}.rollout_rs"] and f"{RC}.loss_type" in bad.refused
    assert "only token_k1" in translate([*BASE, f"{RC}.rollout_rs=token_k3"]).refused[f"{RC}.rollout_rs"]
    assert f"{RC}.rollout_rs_threshold" in translate([*BASE, f"{RC}.rollout_rs=token_k1"]).refused
    assert (
        f"{RC}.rollout_rs_threshold"
        in translate([*BASE, f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=1.2_1.5"]).refused
    )
    bypass = translate([*BASE, f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token"])
    assert set(bypass.refused) == {f"{RC}.bypass_mode"}
    assert config(f"{RC}.bypass_mode=true").algorithm.rollout_correction.behaviour == "sampler"


@pytest.mark.skipif(
    "mis_normaliser" not in RolloutCorrectionConfig.model_fields,
    reason="algorithm.rollout_correction.mis_normaliser is not in ppoflow's config yet (being added)",
)
def test_a_translated_rejection_runs_as_veRL_does_with_the_kept_normaliser():
    cfg = config(f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.999_1.001")
    rc = cfg.algorithm.rollout_correction
    assert rc.mis == "geometric" and rc.mis_normaliser == "kept"
    assert (rc.mis_lower, rc.mis_upper) == pytest.approx((1 / 1.001, 1 / 0.999))


def test_policy_loss_reward_function_and_reward_model():
    assert (
        config(
            f"{A}.policy_loss.loss_mode=gspo", "algorithm.adv_estimator=grpo", f"{R}.n=2"
        ).actor.policy_loss
        == "gspo"
    )
    cfg = config("custom_reward_function.path=~/rewards/mine.py", "custom_reward_function.name=score")
    assert cfg.reward.custom_function == os.path.expanduser("~/rewards/mine.py") + ":score"
    t = translate(
        [*BASE, "reward_model.enable=True", "reward_model.model.path=rm", "custom_reward_function.path=x.py"]
    )
    t.check()
    cfg = parse_config(t.config)
    assert cfg.reward.reward_model.enable and not cfg.reward.rule and cfg.reward.custom_function is None
    assert "rm_scores" in t.ignored["custom_reward_function.path"]
    naive = translate([*BASE, "reward_model.overlong_buffer.enable=True"])
    assert "dapo" in naive.refused["reward_model.overlong_buffer.enable"]


def test_storage_names_fit_ppoflows_rule_and_trainer_settings_map():
    t = translate([*BASE, "trainer.experiment_name=my run/1", "trainer.project_name=proj"])
    assert t.config["storage"] == {"root": "checkpoints/proj", "experiment": "my-run-1"}
    assert any("'my-run-1'" in n and "'my run/1'" in n for n in t.notes)
    assert config("trainer.experiment_name=data").storage.experiment == "data-run"
    cfg = config(
        "trainer.default_local_dir=/ckpt/proj/exp1",
        "trainer.save_freq=-1",
        "trainer.max_actor_ckpt_to_keep=2",
    )
    assert (cfg.storage.root, cfg.storage.experiment) == ("/ckpt/proj", "exp1")
    assert (
        cfg.checkpoint.snapshot_every == NEVER
        and cfg.checkpoint.snapshot_at_end
        and cfg.checkpoint.keep_last == 2
    )
    cfg = config("trainer.n_gpus_per_node=2", "trainer.test_freq=3", "trainer.device=cpu")
    assert (cfg.resources.nprocs, cfg.resources.device, cfg.evaluation.every, cfg.evaluation.at_end) == (
        2,
        "cpu",
        3,
        True,
    )


def test_filter_groups_without_a_limit_and_gen_batch_without_filtering():
    t = translate([*BASE, "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score"])
    assert t.config["algorithm"]["dynamic_sampling"] == {"enable": True, "max_rounds": UNBOUNDED_ROUNDS}
    assert "data.gen_batch_size" in translate([*BASE, "data.gen_batch_size=2048"]).refused


def test_a_config_file_section_sits_under_the_files_own_settings():
    data, t = with_verl(
        {
            "verl": {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 2}}},
            "rollout": {"n": 3},
        },
        [*BASE, "actor_rollout_ref.rollout.n=4"],
    )
    cfg = parse_config(data)
    assert cfg.rollout.n == 3 and cfg.algorithm.adv_estimator == "grpo" and t is not None
    data, _ = with_verl({"verl": ["algorithm.adv_estimator=rloo", *BASE]})
    assert data["algorithm"]["adv_estimator"] == "rloo"
    with pytest.raises(ConfigError, match="trainer.nnodes"):
        with_verl({"verl": ["trainer.nnodes=4"]})


def _docs_keys() -> str:
    with open(os.path.join(ROOT, "docs", "verl.md")) as f:
        return f.read()


def test_every_catalogued_key_is_in_the_docs_and_read_by_the_rules():
    """docs/verl.md names every entry of the catalogue; no mapped key is left to the "not read"
    fallback when given (here with the value null, which no rule may stumble on)."""
    from ppoflow.infra.config.verl.keys import _expand

    docs = _docs_keys()
    specs = [s for table in (MAPPED, CHECKED, IGNORED) for s in table]
    missing = [s for s in specs if f"`{s}`" not in docs and s.removesuffix(".*") not in docs]
    assert not missing, missing
    for key in [k for k in MAPPED if not k.endswith(".*")]:
        t = translate([*BASE, f"{key}=null"])
        assert "does not read" not in t.refused.get(key, ""), key
    assert _expand("a.{b,c}.{d,e}") == ["a.b.d", "a.b.e", "a.c.d", "a.c.e"]
    assert re.search(r"\| `data.train_batch_size` \| `data.train_batch_size`", docs)
