"""The rules for veRL's reward keys (``reward_model.*``, ``reward_manager.*``,
``custom_reward_function.*``) and its ``trainer.*`` keys: the reward, and where, on what and how
long the run runs (storage, resources, checkpoints, evaluation)."""

from __future__ import annotations

import posixpath
import re

from ppoflow.infra.config.names import NAME_PATTERN
from ppoflow.infra.config.system import ROOT_ENTRIES
from ppoflow.infra.config.verl.sections import expand_home, override_config
from ppoflow.infra.config.verl.translator import UNSET, Translator

__all__ = ["RULES", "NEVER", "fit_name"]

#: ``checkpoint.snapshot_every`` for veRL's ``save_freq: -1``: no periodic snapshot, only the one
#: at the end of each run (``checkpoint.snapshot_at_end``).
NEVER = 1_000_000

_OVERLONG = ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg")


def fit_name(name: str, fallback: str) -> str:
    """``name`` made to fit ppoflow's name rule (``ppoflow.infra.config.names``): every run of
    other characters becomes '-', the ends trimmed, at most 128 characters; a name the storage
    root keeps for itself gets '-run'."""
    fixed = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("._-")[:128] or fallback
    if fixed.lower() in ROOT_ENTRIES:
        fixed += "-run"
    assert re.fullmatch(NAME_PATTERN, fixed), fixed
    return fixed


def _reward_model(t: Translator) -> bool:
    """The reward model; whether it is on (its score then replaces the rule's, as in veRL)."""
    rm, on = "reward_model", bool(t.value("reward_model.enable", False))
    t.put("reward.reward_model.enable", on, f"{rm}.enable")
    keys = [k for k in t.given if k.startswith(f"{rm}.model.") or k.startswith(f"{rm}.max_length")]
    if not on:
        for key in keys:
            t.same(key, "read only with reward_model.enable=true")
        return False
    t.put("reward.rule", False, f"{rm}.enable")
    path = t.value(f"{rm}.model.path", "~/models/FsfairX-LLaMA3-RM-v0.1")
    t.put("reward.reward_model.model.path", expand_home(path), f"{rm}.model.path")
    t.copy({f"{rm}.model.trust_remote_code": "reward.reward_model.model.trust_remote_code"})
    override_config(t, f"{rm}.model.override_config", "reward.reward_model.model.override_config")
    fsdp = ("param_offload", "reshard_after_forward", "fsdp_size")
    t.copy({f"{rm}.model.fsdp_config.{k}": f"reward.reward_model.fsdp.{k}" for k in fsdp})
    t.copy({f"{rm}.max_length": "reward.reward_model.max_length"})
    return True


def _reward(t: Translator) -> None:
    on = _reward_model(t)
    managers = ("reward_model.reward_manager", "reward_manager.name")
    manager = next((t.value(k) for k in managers if t.gave(k)), "naive")
    for key in managers:
        if t.gave(key) and t.value(key) not in ("naive", "dapo"):
            t.refuse(
                key,
                f"{t.value(key)!r}: ppoflow scores each row by its rule or custom function, as "
                "veRL's naive and dapo managers do",
            )
    for key in [k for k in t.given if k.startswith("reward_model.reward_kwargs.")]:
        if not key.startswith(f"{_OVERLONG[1]}."):
            t.refuse(key, "a keyword of veRL's reward manager: ppoflow has no such setting")
    given = [p for p in _OVERLONG if t.gave(f"{p}.enable")]
    prefix = given[-1] if given else _OVERLONG[0]
    if t.value(f"{prefix}.enable", False):
        if manager != "dapo":
            t.refuse(
                f"{prefix}.enable",
                f"veRL applies the overlong buffer in its dapo reward manager only, "
                f"not {manager!r}: set reward_model.reward_manager=dapo",
            )
        t.put("reward.overlong_buffer.enable", True, f"{prefix}.enable", *[k for k in managers if t.gave(k)])
        t.copy({f"{prefix}.len": "reward.overlong_buffer.length"})
        t.copy({f"{prefix}.penalty_factor": "reward.overlong_buffer.penalty_factor"})
        if not t.gave(f"{prefix}.len"):
            t.notes.append(
                "reward.overlong_buffer.length: not given; ppoflow's default, a fifth of the response length"
            )
    for key in [f"{p}.{k}" for p in _OVERLONG for k in ("enable", "len", "penalty_factor")]:
        t.same(key, "read only with overlong_buffer.enable=true (and by the dapo reward manager)")
    for key in managers:
        t.same(
            key,
            "ppoflow scores each row by its rule or custom function, as veRL's naive and dapo managers do",
        )
    path, name = (
        t.value("custom_reward_function.path", None),
        t.value("custom_reward_function.name", "compute_score"),
    )
    keys = ("custom_reward_function.path", "custom_reward_function.name")
    if path and not on:
        t.put("reward.custom_function", f"{expand_home(path)}:{name}", *keys)
    for key in keys:
        t.same(
            key,
            "the reward model's score replaces it (veRL's reward manager returns rm_scores)"
            if on
            else "read only with custom_reward_function.path",
        )


def _storage(t: Translator) -> None:
    project = str(t.value("trainer.project_name"))
    name = str(t.value("trainer.experiment_name"))
    local = t.value("trainer.default_local_dir", None)
    if local not in (None, UNSET):
        local = (
            str(local).replace("${trainer.project_name}", project).replace("${trainer.experiment_name}", name)
        )
        root, name = posixpath.split(expand_home(local).rstrip("/"))
        root = root or "."
    else:
        root = "checkpoints/" + fit_name(project, "verl_examples")
    experiment = fit_name(name, "verl-experiment")
    if experiment != name:
        t.notes.append(
            f"storage.experiment: {experiment!r} from veRL's experiment name {name!r} "
            "(ppoflow's names are letters, digits, '.', '_' and '-')"
        )
    sources = ("trainer.project_name", "trainer.default_local_dir")
    t.put("storage.root", root, *sources)
    t.put("storage.experiment", experiment, "trainer.experiment_name", "trainer.default_local_dir")
    if local not in (None, UNSET):
        for key in sources[:1] + ("trainer.experiment_name",):
            t.same(key, "trainer.default_local_dir names the directory")


def _logger(t: Translator) -> None:
    """``trainer.logger`` naming ``wandb`` turns on ``tracking.wandb`` in veRL's project and under
    its experiment's name (veRL logs there). Left out, veRL's default list names wandb too, but a
    tracker changes nothing of what is trained: only a command that names it gets one."""
    key = "trainer.logger"
    if not t.gave(key):
        return
    value = t.value(key)
    names = [value] if isinstance(value, str) else list(value or [])
    if "wandb" not in names:
        t.ignored[key] = (
            "console: ppoflow prints one line per iteration; mlflow: set MLFLOW_TRACKING_URI; "
            "tensorboard: `ppoflow tensorboard`"
        )
        return
    t.put("tracking.wandb.project", str(t.value("trainer.project_name")), key)
    t.put("tracking.wandb.name", str(t.value("trainer.experiment_name")), key)


def _trainer(t: Translator) -> None:
    _storage(t)
    _logger(t)
    tr = "trainer"
    t.copy({f"{tr}.n_gpus_per_node": "resources.nprocs"})
    device = t.value(f"{tr}.device")
    if device is not UNSET and device not in ("cuda", "cpu"):
        t.refuse(f"{tr}.device", f"{device!r}: ppoflow runs on cuda or cpu")
    elif device is not UNSET:
        t.put("resources.device", device, f"{tr}.device")
    save = t.value(f"{tr}.save_freq")
    periodic = isinstance(save, int) and save > 0
    t.put("checkpoint.snapshot_every", save if periodic else NEVER, f"{tr}.save_freq")
    t.put("checkpoint.snapshot_at_end", True, f"{tr}.save_freq")
    test = t.value(f"{tr}.test_freq")
    test = test if isinstance(test, int) and test > 0 else 0
    t.put("evaluation.every", test, f"{tr}.test_freq")
    t.put("evaluation.at_end", test > 0, f"{tr}.test_freq")
    t.put("evaluation.before_training", t.value(f"{tr}.val_before_train"), f"{tr}.val_before_train")
    keep = [k for k in (f"{tr}.max_actor_ckpt_to_keep", f"{tr}.max_critic_ckpt_to_keep") if t.gave(k)]
    if keep:
        values = [t.value(k) for k in keep]
        t.put("checkpoint.keep_last", None if None in values else max(values), *keep)
    mode = t.value(f"{tr}.resume_mode", "auto")
    if mode not in ("auto", "disable"):
        t.refuse(
            f"{tr}.resume_mode",
            f"{mode!r}: ppoflow continues the experiment it names (auto), or with "
            "disable runs only a new one; give the experiment instead of a checkpoint path",
        )
    elif t.gave(f"{tr}.resume_mode"):
        t.mapped[f"{tr}.resume_mode"] = ["run as given (disable: refused when the experiment has iterations)"]
    for key in (f"{tr}.total_training_steps", f"{tr}.total_epochs"):
        if t.gave(key) and t.value(key) is not None:
            t.mapped[key] = ["the iterations `ppoflow run` runs to"]
    if t.value(f"{tr}.total_training_steps", None) not in (None, UNSET):
        t.mapped.pop(f"{tr}.total_epochs", None)
        t.same(f"{tr}.total_epochs", "trainer.total_training_steps is given: veRL stops there")
    t.same(f"{tr}.total_training_steps", "null: trainer.total_epochs decides the length")
    t.same(f"{tr}.total_epochs", "null: veRL's default of 30 epochs, unless total_training_steps is given")


RULES = (_reward, _trainer)
