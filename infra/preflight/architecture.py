"""The preflight's check of the models' architectures against ppoflow's model matrix
(``ppoflow.infra.architectures``): each local model directory's ``config.json`` and what the run
asks of it (packed micro-batches, sequence parallelism, LoRA, the engine's tensor parallelism and
dtype). What cannot work is a problem; an architecture outside the matrix is a note (why:
``ppoflow.infra.architectures.check``).

    check_architectures(cfg, c)       # in preflight(), after the model directories are checked
"""

from __future__ import annotations

import json
import os

from ppoflow.infra.architectures import Settings, architecture_of, config_problems
from ppoflow.infra.config import ExperimentConfig, ModelConfig
from ppoflow.infra.preflight.report import Checks

__all__ = ["check_architectures", "run_settings"]


def run_settings(cfg: ExperimentConfig, role: str) -> Settings:
    """What the run asks of the model of ``role`` ("policy": actor and reference; "critic")."""
    if role == "critic":
        packing, sp, lora = bool(cfg.critic.use_dynamic_bsz), cfg.critic.sequence_parallel_size, False
    else:
        ref_packed = cfg.ref.log_prob_use_dynamic_bsz
        packing = bool(cfg.actor.use_dynamic_bsz or ref_packed)
        sp = max(cfg.actor.sequence_parallel_size, cfg.ref.sequence_parallel_size or 1)
        lora = cfg.actor.lora.enabled
    targets = cfg.actor.lora.target_modules
    return Settings(
        packing=packing,
        sequence_parallel=sp,
        lora=lora,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        tensor_parallel=cfg.rollout.tensor_model_parallel_size if role == "policy" else 1,
        engine=cfg.rollout.engine if role == "policy" else "none",
        engine_dtype=cfg.engine_dtype,
        device=cfg.resources.device,
    )


def _models(cfg: ExperimentConfig) -> list[tuple[str, str, ModelConfig]]:
    out = [("model.path", "policy", cfg.model)]
    if cfg.critic.enable:
        out.append(
            (
                "critic.model.path" if cfg.critic.model else "model.path (the critic's)",
                "critic",
                cfg.critic_model,
            )
        )
    return out


def check_architectures(cfg: ExperimentConfig, c: Checks) -> None:
    """Add the problems and notes of every local model directory's architecture to ``c`` (a hub id
    or a directory without config.json: the model check reports it; nothing read here)."""
    noted: set[str] = set()  # the critic on the policy's model: its note once
    for where, role, model in _models(cfg):
        path = os.path.join(model.path, "config.json")
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            c.problem(
                f"{where}={model.path}", f"config.json does not read as JSON ({exc})", "restore the file"
            )
            continue
        problems, notes = config_problems(config, run_settings(cfg, role), f"{where}={model.path}")
        for problem in problems:
            c.problem(*problem)
        if model.path not in noted:
            c.report.notes.extend(notes)
            noted.add(model.path)
        row = architecture_of(config.get("model_type"))
        if not problems and row is not None:
            c.ok(f"{where}: {row.family} ({row.name}), a row of the model matrix")
