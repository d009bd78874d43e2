"""On-policy distillation on a CPU: a teacher that knows the demo's task (name the larger of two
digits) distilled into the demo's untrained student; the student's held-out score rises.

    python examples/distill/cpu_demo.py [--root runs/distill] [--iterations 16] [--no-baseline]

1. the demo's files (``ppoflow.demo.experiment.prepare``): the tiny Qwen2 (2 layers, hidden 128),
   the problems, and the student: that model after the format warm start (random answers), right
   about one time in ten;
2. the teacher: the same base model fine-tuned on the *right* answers
   (``ppoflow.demo.task.supervised_examples``, ``ppoflow.demo.sft``); its greedy score on the 100
   problems is measured here with transformers;
3. the student distilled from the teacher, ``recipe: distill`` (the teacher's per-token reverse
   KL is the only reward: the task's rule is measured, not trained on; no critic, no reference),
   the demo's batch and learning rate, evaluated greedily on the 100 problems before training and
   every 2 iterations;
4. for comparison, the demo's own PPO from the task reward (``ppoflow demo``'s config: GAE with a
   critic, the reference's KL in the reward) for the same number of iterations (``--no-baseline``
   skips it).

Both runs go through ``ppoflow run`` in this process. Prints the iterations' lines, then one line
per run with its held-out scores and seconds. The models are built once (skipped when they
exist); each run continues its experiment when there is one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TEACHER_STEPS = 200


def teacher_score(model_dir: str) -> float:
    """Greedy accuracy of a model directory on every problem of the task, with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.demo import task

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    problems = task.every_problem()
    for row in problems:
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        right += task.score(task.DATA_SOURCE, answer, row["reward_model"]["ground_truth"]) == 1.0
    return right / len(problems)


def build_teacher(root: str, steps: int) -> str:
    """The base model fine-tuned on the right answers (step 2 of the module docstring)."""
    from ppoflow.demo import task
    from ppoflow.demo.sft import SFTConfig, sft

    out = os.path.join(root, "models", "teacher")
    if not os.path.isdir(out):
        examples = task.supervised_examples(4096, seed=2)
        config = SFTConfig(steps=steps, batch_size=64, lr=1e-3, log_every=100)
        sft(os.path.join(root, "models", "base"), out, examples, config)
    return out


def distill_overrides(teacher: str) -> dict:
    """The demo's config turned into on-policy distillation from ``teacher`` (step 3)."""
    return {
        "recipe": "distill",
        "teacher.model.path": teacher,
        "teacher.log_prob_micro_batch_size_per_gpu": 256,
        "algorithm.adv_estimator": "distill",  # the demo's config names gae: override it
        "algorithm.use_kl_in_reward": False,
        # the demo's rule stays: the distill estimator measures it (score) and does not train on it
        "evaluation.every": 2,
        "storage.experiment": "distilled",
    }


def val_curve(experiment_dir: str, last: int) -> list[tuple[int, float]]:
    """(iteration, greedy held-out score) of every evaluated iteration up to ``last``."""
    import json

    out = []
    for n in range(last + 1):
        path = os.path.join(experiment_dir, "iterations", f"{n:06d}", "eval", "val", "metrics.json")
        if os.path.exists(path):
            with open(path) as f:
                out.append((n, float(json.load(f)["val/score"])))
    return out


def run(config_path: str, iterations: int) -> float:
    """``ppoflow run CONFIG --iterations N`` in this process; its seconds."""
    from ppoflow.cli.main import main as ppoflow

    t0 = time.perf_counter()
    if ppoflow(["run", config_path, "--iterations", str(iterations)]) != 0:
        raise SystemExit(f"ppoflow run {config_path} failed")
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/distill")
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--teacher-steps", type=int, default=TEACHER_STEPS)
    parser.add_argument("--no-baseline", action="store_true", help="skip the demo's PPO from the task reward")
    args = parser.parse_args()

    from ppoflow.demo.experiment import DemoSpec, demo_config, prepare
    from ppoflow.infra.config import dump_config

    root = os.path.abspath(args.root)
    t0 = time.perf_counter()
    prepare(root, log=print)  # the demo's base model, data, student (models/sft) and its config
    teacher = build_teacher(root, args.teacher_steps)
    print(f"teacher {teacher}: greedy score {teacher_score(teacher):.2f} on the 100 problems")
    print(f"student {os.path.join(root, 'models', 'sft')}: the format warm start (random answers)")
    print(f"models ready in {time.perf_counter() - t0:.0f} s")

    runs = {"distilled": DemoSpec(overrides=distill_overrides(teacher))}
    if not args.no_baseline:
        runs["ppo"] = DemoSpec(overrides={"evaluation.every": 2, "storage.experiment": "ppo"})
    seconds = {}
    for name, spec in runs.items():
        cfg = demo_config(root, spec)
        path = os.path.join(root, f"{name}.yaml")
        with open(path, "w") as f:
            f.write(dump_config(cfg))
        print(f"\n== {name}: ppoflow run {path} --iterations {args.iterations}")
        seconds[name] = run(path, args.iterations)
    print()
    for name in runs:
        curve = val_curve(os.path.join(root, name), args.iterations)
        shown = "  ".join(f"it {n}: {s:.2f}" for n, s in curve)
        print(f"{name:>9} ({seconds[name]:.0f} s): held-out score {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
