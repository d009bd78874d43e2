"""The rules for veRL's ``data.*``, ``actor_rollout_ref.*`` and ``critic.*`` keys: what each sets
in ppoflow's ``data``, ``model``, ``actor``, ``ref``, ``rollout``, ``evaluation`` and ``critic``."""

from __future__ import annotations

import os
from typing import Any

from ppoflow.infra.config.verl.keys import REF, A, M, R
from ppoflow.infra.config.verl.translator import UNSET, Translator

__all__ = ["RULES", "expand_home", "choose", "override_config"]


def expand_home(value: Any) -> Any:
    """A path (or list of paths) with a leading ``~`` expanded, as veRL's loaders do."""
    if isinstance(value, list):
        return [expand_home(v) for v in value]
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def choose(t: Translator, key: str, target: str, allowed: list[str], what: str) -> None:
    """``target`` = ``key``'s value when it is one of ``allowed``; else the key is refused."""
    value = t.value(key)
    if value is UNSET:
        return
    if value not in allowed:
        t.refuse(key, f"{value!r}: ppoflow has no such {what} (it has {', '.join(sorted(allowed))})")
        return
    t.put(target, value, key)


def _data(t: Translator) -> None:
    t.copy({"data.train_files": "data.train_files", "data.val_files": "data.val_files"}, expand_home)
    t.copy(
        {
            "data.train_batch_size": "data.train_batch_size",
            "data.prompt_key": "data.prompt_key",
            "data.shuffle": "data.shuffle",
            "data.filter_overlong_prompts": "data.filter_overlong_prompts",
        }
    )
    if t.value("data.seed", None) is None:
        t.same("data.seed", "null: ppoflow seeds the shuffle from data.seed's default")
    else:
        t.put("data.seed", t.value("data.seed"), "data.seed")
    choose(t, "data.truncation", "data.truncation", ["error", "left", "right"], "truncation")
    for data_key, engine_key, target in (
        ("data.max_prompt_length", f"{R}.prompt_length", "rollout.prompt_length"),
        ("data.max_response_length", f"{R}.response_length", "rollout.response_length"),
    ):
        if t.gave(engine_key) and t.gave(data_key) and t.value(engine_key) != t.value(data_key):
            t.refuse(engine_key, f"differs from {data_key}: ppoflow has one length for both")
        elif t.gave(engine_key):
            t.put(target, t.value(engine_key), engine_key, data_key)
        else:
            t.put(target, t.value(data_key), data_key)
    limit = t.value("data.val_max_samples", -1)
    if limit is None or limit is UNSET or limit <= 0:
        t.same("data.val_max_samples", "every held-out row, as ppoflow evaluates by default")
    elif t.value("data.shuffle"):
        t.refuse(
            "data.val_max_samples",
            "with data.shuffle=true veRL evaluates a random subset: ppoflow "
            "evaluates the first rows only (evaluation.max_prompts)",
        )
    else:
        t.put("evaluation.max_prompts", limit, "data.val_max_samples")


def override_config(t: Translator, key: str, target: str) -> None:
    """A model's ``override_config``: given whole, key by key (``override_config.x=1``), or both."""
    whole = t.value(key)
    merged = dict(whole) if isinstance(whole, dict) else {}
    parts = [k for k in t.given if k.startswith(key + ".")]
    for part in parts:
        node = merged
        *parents, leaf = part[len(key) + 1 :].split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t.given[part]
    if whole is not UNSET or parts:
        t.put(target, merged, key, *parts)


def _model(t: Translator) -> None:
    t.copy({f"{M}.path": "model.path", f"{M}.tokenizer_path": "model.tokenizer_path"}, expand_home)
    t.copy(
        {
            f"{M}.trust_remote_code": "model.trust_remote_code",
            f"{M}.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
            f"{M}.lora_rank": "actor.lora.rank",
            f"{M}.lora_alpha": "actor.lora.alpha",
            f"{M}.target_modules": "actor.lora.target_modules",
        }
    )
    override_config(t, f"{M}.override_config", "model.override_config")
    t.dtype(f"{A}.fsdp_config.model_dtype", "model.dtype")


def _actor(t: Translator) -> None:
    from ppoflow.algos import KL_PENALTY_KINDS, LOSS_AGG_MODES, POLICY_LOSSES

    t.copy({f"{A}.ppo_mini_batch_size": "actor.ppo_mini_batch_size"})
    both = f"{A}.clip_ratio"
    read = False
    for side in ("low", "high"):
        key = f"{A}.clip_ratio_{side}"
        value = t.value(key, 0.2)
        if value is None or value is UNSET:  # veRL falls back on clip_ratio
            t.put(f"actor.clip_ratio_{side}", t.value(both, 0.2), key, both)
            read = True
        else:
            t.put(f"actor.clip_ratio_{side}", value, key)
    if not read:
        t.same(both, "veRL reads it only where clip_ratio_low or clip_ratio_high is null; both are set")
    t.copy(
        {f"{A}.{k}": f"actor.{k}" for k in ("clip_ratio_c", "entropy_coeff", "use_kl_loss", "kl_loss_coef")}
    )
    t.copy({f"{A}.{k}": f"actor.{k}" for k in ("ppo_epochs", "shuffle")})
    choose(t, f"{A}.loss_agg_mode", "actor.loss_agg_mode", list(LOSS_AGG_MODES), "loss_agg_mode")
    choose(t, f"{A}.kl_loss_type", "actor.kl_loss_type", list(KL_PENALTY_KINDS), "KL estimator")
    choose(t, f"{A}.policy_loss.loss_mode", "actor.policy_loss", list(POLICY_LOSSES), "policy loss")
    _trained(t, A, "actor")
    for key in (f"{A}.fsdp_config.ulysses_sequence_parallel_size", f"{A}.ulysses_sequence_parallel_size"):
        t.copy({key: "actor.sequence_parallel_size"})
    fsdp = ("param_offload", "reshard_after_forward", "fsdp_size")
    t.copy({f"{REF}.fsdp_config.{k}": f"ref.fsdp.{k}" for k in fsdp})
    t.dtype(f"{REF}.fsdp_config.dtype", "ref.fsdp.param_dtype")
    t.copy({f"{REF}.ulysses_sequence_parallel_size": "ref.sequence_parallel_size"})
    keys = [f"{s}.fsdp_config.full_determinism" for s in (A, "critic.model")]
    if any(t.value(k) is True for k in keys):
        t.put("resources.deterministic", True, *keys)
    elif any(t.gave(k) for k in keys):
        t.put("resources.deterministic", False, *keys)


def _trained(t: Translator, section: str, name: str) -> None:
    """A trained model's optimizer and FSDP settings: veRL's ``<section>.optim.*``,
    ``grad_clip`` and the FSDP engine's (``<section>.fsdp_config`` or, for the critic,
    ``critic.model.fsdp_config``) onto ppoflow's ``<name>.optim`` and ``<name>.fsdp``."""
    t.copy({f"{section}.optim.{k}": f"{name}.optim.{k}" for k in ("lr", "weight_decay")})
    t.copy({f"{section}.optim.betas": f"{name}.optim.betas"}, lambda v: v if v is None else list(v))
    for key in (f"{section}.grad_clip", f"{section}.optim.clip_grad"):
        t.copy({key: f"{name}.optim.grad_clip"})
    fsdp = f"{section}.fsdp_config" if name == "actor" else "critic.model.fsdp_config"
    keys = ("param_offload", "optimizer_offload", "reshard_after_forward", "fsdp_size")
    t.copy({f"{fsdp}.{k}": f"{name}.fsdp.{k}" for k in keys})
    t.dtype(f"{fsdp}.dtype", f"{name}.fsdp.param_dtype")


def _rollout(t: Translator) -> None:
    name = t.value(f"{R}.name")
    engines = {"vllm": "vllm", "hf": "hf"}
    if name is not UNSET and name not in engines:
        t.refuse(f"{R}.name", f"{name!r}: ppoflow's rollout engines are vllm and hf")
    elif name is not UNSET:
        t.put("rollout.engine", engines[name], f"{R}.name")
    keys = ("n", "temperature", "top_p", "top_k", "tensor_model_parallel_size", "calculate_log_probs")
    t.copy({f"{R}.{k}": f"rollout.{k}" for k in keys})
    t.dtype(f"{R}.dtype", "rollout.dtype")
    val = f"{R}.val_kwargs"
    if t.value(f"{val}.do_sample", False):
        t.put(
            "evaluation.temperature",
            t.value(f"{val}.temperature", 0.0),
            f"{val}.do_sample",
            f"{val}.temperature",
        )
    else:
        t.put("evaluation.temperature", 0.0, f"{val}.do_sample")
        t.same(f"{val}.temperature", "read only with val_kwargs.do_sample=true (greedy otherwise)")
    t.copy({f"{val}.{k}": f"evaluation.{k}" for k in ("n", "top_p", "top_k")})


def _critic(t: Translator) -> None:
    if t.value("critic.enable", None) is None:
        t.same(
            "critic.enable",
            "null: ppoflow turns the critic on exactly for estimators that read values, as veRL",
        )
    else:
        t.put("critic.enable", t.value("critic.enable"), "critic.enable")
    for key in ("ppo_mini_batch_size", "ppo_epochs", "shuffle", "loss_agg_mode"):  # default: the actor's
        value = t.value(f"critic.{key}")
        t.put(f"critic.{key}", t.value(f"{A}.{key}") if value is UNSET else value, f"critic.{key}")
    t.copy({"critic.cliprange_value": "critic.cliprange_value"})
    t.copy({"critic.ulysses_sequence_parallel_size": "critic.sequence_parallel_size"})
    _trained(t, "critic", "critic")
    model = "critic.model"
    t.copy({f"{model}.lora_rank": "critic.lora.rank", f"{model}.lora_alpha": "critic.lora.alpha"})
    t.copy({f"{model}.target_modules": "critic.lora.target_modules"})
    keys = [
        f"{model}.{k}"
        for k in ("path", "tokenizer_path", "trust_remote_code", "enable_gradient_checkpointing")
    ]
    keys += [f"{model}.fsdp_config.model_dtype"]
    if not any(t.gave(k) for k in keys) and not any(
        k.startswith(f"{model}.override_config") for k in t.given
    ):
        return
    actor_path = expand_home(t.value(f"{M}.path"))
    t.put("critic.model.path", expand_home(t.value(f"{model}.path", actor_path)), f"{model}.path")
    tokenizer = t.value(f"{model}.tokenizer_path")  # veRL's default: the actor's model
    tokenizer = (
        expand_home(t.value(f"{M}.tokenizer_path", None) or actor_path) if tokenizer is UNSET else tokenizer
    )
    t.put("critic.model.tokenizer_path", expand_home(tokenizer), f"{model}.tokenizer_path")
    t.copy({f"{model}.trust_remote_code": "critic.model.trust_remote_code"})
    t.copy({f"{model}.enable_gradient_checkpointing": "critic.model.enable_gradient_checkpointing"})
    override_config(t, f"{model}.override_config", "critic.model.override_config")
    t.dtype(f"{model}.fsdp_config.model_dtype", "critic.model.dtype")


RULES = (_data, _model, _actor, _rollout, _critic)
