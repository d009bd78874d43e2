"""``ppoflow demo``: PPO learns to name the larger of two digits on a CPU, end to end, in minutes.

What it does, under one directory (``runs/demo`` by default)::

    models/base/         a tiny Qwen2 (2 layers, hidden 128) + byte-level tokenizer, random weights
    data/train.parquet   1,024 problems "max(3,7)=" in veRL's prompt format (infra.demo_task)
    models/sft/          the base after the format warm start (workers.sft): answers with one
                         number and stops, right only by chance (random answers in training)
    config.yaml          the experiment config (edit it to change the next runs)
    larger-digit/        the experiment: manifest.json, iterations/, checkpoints/, plots/

then runs the real ``ppo`` flow on ``config.yaml``: 2 gloo ranks per worker group, vLLM's CPU
build for rollouts, the rule reward of ``infra.demo_task``, GAE with a critic, the reference
policy's KL in the reward, a DCP checkpoint per iteration. Nothing in the flow knows it is a
demo: :func:`prepare` builds files and a config, :func:`run_with_progress` calls the flow.

Why these settings (measured with this flow and a single-process prototype on a 2-core CPU):
- ``initializer_range=0.1``: with 0.02 a 2-layer model's answer barely depends on its prompt
  (hidden state at the answer position varies by ~0.3% across prompts after the warm start) and
  PPO needed far more than 30 iterations to start; 0.1 keeps it learnable within ~10.
- Supervised training on random answers makes any model prompt-blind at the answer position (it
  is the loss optimum), so the warm start is short (100 steps) and only teaches the format.
- actor lr 5e-4, 2 PPO epochs of 4 mini-batches, KL to the warm-started reference in the reward
  (coefficient 0.05): with lr 1e-3 a single iteration moved the policy by a PPO-KL of 0.1-0.4,
  and the reward rose, then fell again.

Idempotent: each file above is built once (published by a rename when complete); a second
``ppoflow demo`` reuses them, loads ``config.yaml`` and continues the experiment from its last
committed iteration. The deployment's embedded default (``flows/deployment.py``) calls
:func:`prepare` too, so both train the same experiment.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from infra import storage
from infra.config import ExperimentConfig, dump_config, load_config, parse_config
from workers.sft import SFTConfig

__all__ = ["DemoSpec", "DEFAULT_ITERATIONS", "CONTINUE_ITERATIONS", "EXPERIMENT", "prepare", "demo_config",
           "run_demo", "run_with_progress", "print_summary", "iteration_line"]

#: Iterations of a new demo, and of each later ``ppoflow demo`` without ``--iterations``.
DEFAULT_ITERATIONS = 40
CONTINUE_ITERATIONS = 10
EXPERIMENT = "larger-digit"


@dataclass(frozen=True)
class DemoSpec:
    """Everything the demo builds; the defaults are the measured ones (see the module docstring)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2                  # head_dim 64 (vLLM's CPU attention needs >= 32)
    num_kv_heads: int = 1
    initializer_range: float = 0.1      # ~1/sqrt(hidden): 0.02 leaves a 2-layer model nearly blind to the prompt
    model_seed: int = 0
    max_digit: int = 9
    prompts: int = 1024
    data_seed: int = 0
    sft_examples: int = 4096
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=100, batch_size=64, lr=1e-3, log_every=25))
    overrides: dict[str, Any] = field(default_factory=dict)   # dotted config keys, e.g. {"rollout.n": 4}


def _local_dir(location: str) -> str:
    if "://" in location and not location.startswith("file://"):
        raise ValueError(f"the demo builds Hugging Face model directories and needs local storage; "
                         f"{location!r} is not a local path")
    return os.path.abspath(location.removeprefix("file://"))


def demo_config(root: str, spec: DemoSpec = DemoSpec()) -> ExperimentConfig:
    """The demo experiment's config for the files under ``root`` (see the module docstring)."""
    data: dict[str, Any] = {
        "model": {"path": os.path.join(root, "models", "sft")},
        "data": {"train_files": [os.path.join(root, "data", "train.parquet")], "train_batch_size": 64,
                 "shuffle": True, "seed": 0},
        "rollout": {"engine": "vllm", "n": 8, "temperature": 1.0, "prompt_length": 16, "response_length": 4,
                    "kv_cache_gib": 0.05, "max_num_seqs": 512, "log_prob_micro_batch_size_per_gpu": 256},
        "actor": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 64, "ppo_epochs": 2,
                  "log_prob_micro_batch_size_per_gpu": 256, "optim": {"lr": 5e-4}},
        "ref": {"log_prob_micro_batch_size_per_gpu": 256},
        "critic": {"ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 64, "ppo_epochs": 2,
                   "forward_micro_batch_size_per_gpu": 256, "optim": {"lr": 1e-3}},
        # The rule is registered for the data's data_source (infra.demo_task); naming it here too
        # makes the config self-contained: any process that runs it (ppoflow run, a deployment
        # worker) imports the function, whether or not it imported infra.demo_task.
        "reward": {"rule": True, "custom_function": "infra.demo_task:score"},
        "algorithm": {"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0, "use_kl_in_reward": True,
                      "kl_penalty": "kl", "kl_ctrl": {"type": "fixed", "kl_coef": 0.05}},
        "storage": {"root": root, "experiment": EXPERIMENT},
        "resources": {"nprocs": 2, "device": "cpu"},
        "seed": 0,
    }
    for key, value in spec.overrides.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return parse_config(data, source="demo config")


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


def prepare(location: str = "runs/demo", spec: DemoSpec = DemoSpec(),
            log: Callable[[str], None] | None = print) -> ExperimentConfig:
    """Build whatever of the demo is missing under ``location``; return its experiment config.

    An existing ``config.yaml`` is loaded as it is (edits to it apply); files that exist are reused.
    """
    from infra import demo_task  # noqa: F401 - also registers the task's reward for its data_source
    from infra.tiny_models import save_tiny_model
    from workers.sft import sft

    say = log or (lambda _msg: None)
    root = _local_dir(location)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars; the demo prints its own steps
    config_path = os.path.join(root, "config.yaml")
    if os.path.exists(config_path):
        return load_config(config_path)
    base, warm = os.path.join(root, "models", "base"), os.path.join(root, "models", "sft")
    data = os.path.join(root, "data", "train.parquet")
    if not os.path.isdir(base):
        say(f"building the tiny policy: Qwen2, {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"byte-level tokenizer -> {base}")
        _publish_dir(lambda tmp: save_tiny_model(
            tmp, seed=spec.model_seed, hidden_size=spec.hidden_size, num_layers=spec.num_layers,
            num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
            initializer_range=spec.initializer_range), base)
    if not os.path.exists(data):
        say(f"writing {spec.prompts} problems 'max(a,b)=' (digits 0..{spec.max_digit}) -> {data}")
        demo_task.write_parquet(demo_task.build_rows(spec.prompts, seed=spec.data_seed, max_digit=spec.max_digit), data)
    if not os.path.isdir(warm):
        say(f"warm start: {spec.sft.steps} supervised steps on the answer format with random answers -> {warm}")
        examples = demo_task.warm_start_examples(spec.sft_examples, seed=spec.data_seed + 1, max_digit=spec.max_digit)
        _publish_dir(lambda tmp: sft(base, tmp, examples, spec.sft, log=say), warm)
    cfg = demo_config(root, spec)
    storage.write_bytes_atomic(config_path, dump_config(cfg).encode())
    say(f"experiment config -> {config_path}")
    return cfg


# ------------------------------------------------------------------------------- running + output

KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl")


def _fmt(metrics: dict[str, Any], key: str, spec: str) -> str:
    value = metrics.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def iteration_line(n: int, metrics: dict[str, Any]) -> str:
    """One terminal line per committed iteration: reward (the mean rule score), KL to the
    reference policy, mean response length, entropy, wall seconds."""
    kl_key = next((k for k in KL_KEYS if k in metrics), KL_KEYS[0])
    return (f"iteration {n:4d} | reward {_fmt(metrics, 'critic/score/mean', '.3f')} | "
            f"kl {_fmt(metrics, kl_key, '.4f')} | response length {_fmt(metrics, 'response_length/mean', '.2f')} | "
            f"entropy {_fmt(metrics, 'actor/entropy', '.3f')} | {_fmt(metrics, 'timing_s/iteration', '.1f')} s")


class _Progress(threading.Thread):
    """Prints :func:`iteration_line` for each iteration the flow commits (polls the manifest)."""

    def __init__(self, cfg: ExperimentConfig, out: Callable[[str], None], poll_s: float = 0.5,
                 quiet_s: float = 90.0):
        super().__init__(name="ppoflow-progress", daemon=True)
        from infra.manifest import ExperimentPaths
        from tasks.slots import limit_name

        self.paths, self.out, self.poll_s, self.quiet_s = ExperimentPaths.of(cfg), out, poll_s, quiet_s
        self.limit = limit_name(cfg.resources.device)
        self.stop_event = threading.Event()
        self.shown = 0
        self.shown = self._committed()  # iterations committed before this run are not shown
        self.last_news = time.monotonic()

    def _committed(self) -> int:
        try:
            return int(storage.read_json(self.paths.manifest)["iteration"])
        except Exception:  # not there yet, or a transient read error: try again next poll
            return self.shown

    def poll(self) -> None:
        current = self._committed()
        while self.shown < current:
            n = self.shown + 1
            try:
                metrics = storage.read_json(self.paths.file(n, "metrics.json"))
            except Exception:
                return
            self.out(iteration_line(n, metrics))
            self.shown = n
            self.last_news = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            self.poll()
            if time.monotonic() - self.last_news > self.quiet_s:
                self.out(f"... no iteration committed for {self.quiet_s:.0f} s: still starting, or waiting for this "
                         f"machine's device slots while another ppoflow run holds them (prefect gcl inspect "
                         f"{self.limit})")
                self.last_news = time.monotonic()

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)
        self.poll()


def run_with_progress(cfg: ExperimentConfig, iterations: int, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the ``ppo`` flow in this process, printing a line per committed iteration.

    Returns ``{ok, result, error, flow_run_id, wall_s}`` (``result``: what the flow returned).
    """
    from flows.ppo import ppo

    progress = _Progress(cfg, out)
    progress.start()
    started = time.time()
    try:
        state = ppo(cfg, iterations, return_state=True)
    finally:
        progress.finish()
    ok = state.is_completed()
    result = state.result(raise_on_failure=False)
    return {"ok": ok, "result": result if ok else None, "error": None if ok else f"{state.name}: {result}",
            "flow_run_id": str(state.state_details.flow_run_id), "wall_s": time.time() - started}


def command(name: str) -> str:
    """How to call the console script ``name`` of this environment from the user's shell: the bare
    name when it is on PATH, else its path (e.g. ``.venv/bin/prefect`` after ``make demo``)."""
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), name)
    found = shutil.which(name)
    if not os.path.exists(here) or (found and os.path.realpath(found) == os.path.realpath(here)):
        return name
    rel = os.path.relpath(here)
    return rel if not rel.startswith("..") else here


def _ui_hint(flow_run_id: str | None) -> list[str]:
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    path = f"/runs/flow-run/{flow_run_id}" if flow_run_id else "/runs"
    if api:
        ui = api[:-4] if api.endswith("/api") else api
        return [f"Prefect UI:        {ui}{path}"]
    return [f"Prefect UI:        {command('prefect')} server start      (this run is in the local Prefect database)",
            f"                   then open http://127.0.0.1:4200{path}"]


def print_summary(cfg: ExperimentConfig, run: dict[str, Any], config_path: str | None = None,
                  wall_s: float | None = None, out: Callable[[str], None] = print) -> None:
    """Where the experiment lives, its reward trend, the plot, and the commands to go on."""
    from infra.manifest import ExperimentPaths, read_manifest

    paths = ExperimentPaths.of(cfg)
    manifest = read_manifest(paths)
    wall = run["wall_s"] if wall_s is None else wall_s
    out("")
    if not run["ok"]:
        out(f"the flow run failed: {run['error']}")
    out(f"experiment:        {paths.root}   (iteration {manifest.iteration if manifest else 0} committed)")
    trend = [r for r in (manifest.trend if manifest else []) if "critic/score/mean" in r]
    if trend:
        first, last = trend[0], trend[-1]
        delta = last["critic/score/mean"] - first["critic/score/mean"]
        out(f"reward:            iteration {first['iteration']}: {first['critic/score/mean']:.3f} -> iteration "
            f"{last['iteration']}: {last['critic/score/mean']:.3f}   (difference {delta:+.3f})")
    out(f"wall time:         {wall:.0f} s ({wall / 60:.1f} min)")
    plot = storage.join(paths.root, "plots", "metrics.png")
    if storage.exists(plot):
        out(f"plot:              {plot}")
    ppoflow, prefect = command("ppoflow"), command("prefect")
    out(f"metrics:           {paths.root}/iterations/<n>/metrics.json   ({ppoflow} status {paths.root})")
    out(f"TensorBoard:       {ppoflow} tensorboard {paths.root} && {command('tensorboard')} --logdir "
        f"{paths.root}/tensorboard")
    for line in _ui_hint(run.get("flow_run_id")):
        out(line)
    cfg_arg = config_path or "<config.yaml>"
    out(f"continue training: {ppoflow} run {cfg_arg} --iterations 20")
    out(f"   or deployment:  {prefect} deploy -n iteration && {prefect} deployment run ppo/iteration "
        "-p iterations=20   (README: Running PPO as a Prefect deployment)")
    out(f"export the policy: {ppoflow} export-hf {paths.root} {os.path.join(os.path.dirname(paths.root), 'export')}")


def run_demo(location: str = "runs/demo", iterations: int | None = None, spec: DemoSpec = DemoSpec(),
             out: Callable[[str], None] = print) -> dict[str, Any]:
    """Prepare the demo under ``location`` and train it (see the module docstring).

    ``iterations`` None: :data:`DEFAULT_ITERATIONS` on a new experiment, :data:`CONTINUE_ITERATIONS`
    more on one that has already run. Returns :func:`run_with_progress`'s dict.
    """
    from infra.manifest import ExperimentPaths, read_manifest

    started = time.time()
    out(f"ppoflow demo: PPO teaches a tiny Qwen2 to name the larger of two digits, on {os.cpu_count()} CPU cores")
    cfg = prepare(location, spec, log=out)
    manifest = read_manifest(ExperimentPaths.of(cfg))
    done = manifest.iteration if manifest else 0
    if iterations is None:
        iterations = CONTINUE_ITERATIONS if done else DEFAULT_ITERATIONS
    if done:
        out(f"continuing the experiment at {cfg.storage.experiment_url} after iteration {done}: "
            f"{iterations} more (models, data and config.yaml reused)")
    out(f"running the ppo flow for {iterations} iterations: {cfg.data.train_batch_size} prompts x "
        f"{cfg.rollout.n} samples each, {cfg.resources.nprocs} ranks, vLLM rollouts, critic + GAE "
        f"(starting Prefect and the worker groups takes a little while)")
    run = run_with_progress(cfg, iterations, out)
    print_summary(cfg, run, config_path=os.path.join(_local_dir(location), "config.yaml"),
                  wall_s=time.time() - started, out=out)
    return run
