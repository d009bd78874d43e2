"""The demo experiment: what ``ppoflow demo`` (and the deployment's embedded default) trains.

Under one directory (``runs/demo`` by default)::

    models/base/         a tiny Qwen2 (2 layers, hidden 128) + byte-level tokenizer, random weights
    data/train.parquet   1,024 problems "max(3,7)=" in veRL's prompt format (ppoflow.demo.task)
    models/sft/          the base after the format warm start (ppoflow.demo.sft): answers with one
                         number and stops, right only by chance (random answers in training)
    config.yaml          the experiment config (edit it to change the next runs)
    larger-digit/        the experiment: manifest.json, iterations/, checkpoints/, plots/

The config runs the real ``ppo`` flow: 2 gloo ranks per worker group, vLLM's CPU build for
rollouts, the rule reward of ``ppoflow.demo.task``, GAE with a critic, the reference policy's KL in
the reward, a DCP checkpoint per iteration. Nothing in the flow knows it is a demo: :func:`prepare`
builds files and a config.

Why these settings (tried with this flow and a single-process prototype):
- ``initializer_range=0.1``: with 0.02 a 2-layer model's answer barely depends on its prompt
  after the warm start, and PPO took far longer to start learning; 0.1 keeps it learnable
  within the demo's first iterations.
- Supervised training on random answers makes any model prompt-blind at the answer position (it
  is the loss optimum), so the warm start is short (100 steps) and only teaches the format.
- actor lr 5e-4, 2 PPO epochs of 4 mini-batches, KL to the warm-started reference in the reward
  (coefficient 0.05): with lr 1e-3 a single iteration moved the policy by a PPO-KL of 0.1-0.4,
  and the reward rose, then fell again.

Idempotent: each file above is built once (published by a rename when complete); a second call
reuses them and loads ``config.yaml`` as it is.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppoflow.demo.sft import SFTConfig
from ppoflow.infra.config import ExperimentConfig, apply_overrides, dump_config, load_config, parse_config
from ppoflow.infra.data import storage

__all__ = [
    "DemoSpec",
    "DEFAULT_SPEC",
    "DEFAULT_ITERATIONS",
    "CONTINUE_ITERATIONS",
    "EXPERIMENT",
    "prepare",
    "demo_config",
    "local_dir",
]

#: Iterations of a new demo, and of each later ``ppoflow demo`` without ``--iterations``.
DEFAULT_ITERATIONS = 40
CONTINUE_ITERATIONS = 10
EXPERIMENT = "larger-digit"


@dataclass(frozen=True)
class DemoSpec:
    """Everything the demo builds; the defaults are the measured ones (see the module docstring)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # head_dim 64 (vLLM's CPU attention needs >= 32)
    num_kv_heads: int = 1
    initializer_range: float = 0.1  # ~1/sqrt(hidden): 0.02 leaves a 2-layer model nearly blind to the prompt
    model_seed: int = 0
    max_digit: int = 9
    prompts: int = 1024
    data_seed: int = 0
    sft_examples: int = 4096
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=100, batch_size=64, lr=1e-3, log_every=25))
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted config keys, e.g. {"rollout.n": 4}


#: The demo as ``ppoflow demo`` builds it.
DEFAULT_SPEC = DemoSpec()


def local_dir(location: str) -> str:
    if "://" in location and not location.startswith("file://"):
        raise ValueError(
            f"the demo builds Hugging Face model directories and needs local storage; "
            f"{location!r} is not a local path"
        )
    return os.path.abspath(location.removeprefix("file://"))


def demo_config(root: str, spec: DemoSpec = DEFAULT_SPEC) -> ExperimentConfig:
    """The demo experiment's config for the files under ``root`` (see the module docstring)."""
    data: dict[str, Any] = {
        "model": {"path": os.path.join(root, "models", "sft")},
        "data": {
            "train_files": [os.path.join(root, "data", "train.parquet")],
            "val_files": [os.path.join(root, "data", "val.parquet")],
            "train_batch_size": 64,
            "shuffle": True,
            "seed": 0,
        },
        "rollout": {
            "engine": "vllm",
            "n": 8,
            "temperature": 1.0,
            "prompt_length": 16,
            "response_length": 4,
            "kv_cache_gib": 0.05,
            "max_num_seqs": 512,
            "log_prob_micro_batch_size_per_gpu": 256,
        },
        "actor": {
            "ppo_mini_batch_size": 16,
            "ppo_micro_batch_size_per_gpu": 64,
            "ppo_epochs": 2,
            "log_prob_micro_batch_size_per_gpu": 256,
            "optim": {"lr": 5e-4},
        },
        "ref": {"log_prob_micro_batch_size_per_gpu": 256},
        "critic": {
            "ppo_mini_batch_size": 16,
            "ppo_micro_batch_size_per_gpu": 64,
            "ppo_epochs": 2,
            "forward_micro_batch_size_per_gpu": 256,
            "optim": {"lr": 1e-3},
        },
        # The rule is registered for the data's data_source (ppoflow.demo.task); naming it here too
        # makes the config self-contained: any process that runs it (ppoflow run, a deployment
        # worker) imports the function, whether or not it imported ppoflow.demo.task.
        "reward": {"rule": True, "custom_function": "ppoflow.demo.task:score"},
        "algorithm": {
            "adv_estimator": "gae",
            "gamma": 1.0,
            "lam": 1.0,
            "use_kl_in_reward": True,
            "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.05},
        },
        "evaluation": {"every": 10, "before_training": True, "at_end": True},
        "storage": {"root": root, "experiment": EXPERIMENT},
        "resources": {"nprocs": 2, "device": "cpu"},
        "seed": 0,
    }
    return parse_config(apply_overrides(data, spec.overrides), source="demo config")


def _publish_dir(build: Callable[[str], Any], final: str) -> None:
    """Run ``build(tmp_dir)`` and rename the finished directory to ``final`` (a concurrent
    builder that got there first wins; ours is discarded)."""
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(
    location: str = "runs/demo", spec: DemoSpec = DEFAULT_SPEC, log: Callable[[str], None] | None = print
) -> ExperimentConfig:
    """Build whatever of the demo is missing under ``location``; return its experiment config.

    An existing ``config.yaml`` is loaded as it is (edits to it apply); files that exist are reused.
    """
    from ppoflow.demo import task as demo_task
    from ppoflow.demo.sft import sft
    from ppoflow.demo.tiny_models import save_tiny_model

    say = log or (lambda _msg: None)
    root = local_dir(location)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars; the demo prints its own steps
    config_path = os.path.join(root, "config.yaml")
    if os.path.exists(config_path):
        return load_config(config_path)
    base, warm = os.path.join(root, "models", "base"), os.path.join(root, "models", "sft")
    data = os.path.join(root, "data", "train.parquet")
    if not os.path.isdir(base):
        say(
            f"building the tiny policy: Qwen2, {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"byte-level tokenizer -> {base}"
        )
        _publish_dir(
            lambda tmp: save_tiny_model(
                tmp,
                seed=spec.model_seed,
                hidden_size=spec.hidden_size,
                num_layers=spec.num_layers,
                num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads,
                initializer_range=spec.initializer_range,
            ),
            base,
        )
    if not os.path.exists(data):
        say(f"writing {spec.prompts} problems 'max(a,b)=' (digits 0..{spec.max_digit}) -> {data}")
        demo_task.write_parquet(
            demo_task.build_rows(spec.prompts, seed=spec.data_seed, max_digit=spec.max_digit), data
        )
    val = os.path.join(root, "data", "val.parquet")
    if not os.path.exists(val):
        say(f"writing every problem once, for the greedy evaluation -> {val}")
        demo_task.write_parquet(demo_task.every_problem(spec.max_digit), val)
    if not os.path.isdir(warm):
        say(
            f"warm start: {spec.sft.steps} supervised steps on the answer format with random answers -> {warm}"
        )
        examples = demo_task.warm_start_examples(
            spec.sft_examples, seed=spec.data_seed + 1, max_digit=spec.max_digit
        )
        _publish_dir(lambda tmp: sft(base, tmp, examples, spec.sft, log=say), warm)
    cfg = demo_config(root, spec)
    storage.write_bytes_atomic(config_path, dump_config(cfg).encode())
    say(f"experiment config -> {config_path}")
    return cfg
