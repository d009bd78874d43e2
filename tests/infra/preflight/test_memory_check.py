"""The memory plan in the preflight (``ppoflow.infra.preflight.memory_check``): the GPU's memory as
``nvidia-smi`` reports it for the GPUs the ranks will see, the refusal of an 8B full fine-tune
with a critic on one 80 GB GPU (its numbers, and fixes each replanned here independently), the
``auto`` budgets raised to the largest that fits (and the next step up shown not to), and the
CPU ranks' check, which adds the plan to the measured rank runtime."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ppoflow.infra.config import ExperimentConfig, apply_overrides, parse_config
from ppoflow.infra.config.names import given_auto
from ppoflow.infra.preflight.memory_check import SPARE, check_memory, gpu_capacity, refine_auto_budgets
from ppoflow.infra.preflight.memory_fixes import BUDGET_STEP, largest_budget, memory_fixes, model_shapes
from ppoflow.infra.preflight.memory_plan import GIB, memory_plan
from ppoflow.infra.preflight.report import Checks, PreflightError
from ppoflow.infra.preflight.resources import ACTOR_RANK_MIB, CRITIC_RANK_MIB, check_resources
from tests.infra.preflight.test_model_shape import LLAMA_8B, QWEN_05B

H100 = int(79.6 * GIB)


def config(tmp_path, shape: dict, **over) -> ExperimentConfig:
    """What a user writes for one GPU (model, data, estimator; the rest defaults), on ``shape``."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(shape))
    data = {
        "model": {"path": str(model)},
        "data": {"train_files": ["x.parquet"], "train_batch_size": 256},
        "rollout": {"prompt_length": 512, "response_length": 256},
        "algorithm": {"adv_estimator": "gae"},
        "storage": {"root": str(tmp_path / "runs"), "experiment": "e"},
        "resources": {"device": "cuda", "nprocs": 1},
    }
    return parse_config(apply_overrides(data, over))


def peak(cfg: ExperimentConfig, capacity: int = H100) -> int:
    shapes = model_shapes(cfg)
    assert shapes is not None
    return memory_plan(cfg, shapes, capacity).peak()[1]


def fake_nvidia_smi(tmp_path, rows: str) -> str:
    """A directory holding an ``nvidia-smi`` that prints ``rows`` (the query's CSV), for PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\ncat <<'EOF'\n{rows}\nEOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


def test_gpu_memory_is_read_for_the_gpus_the_ranks_see(tmp_path, monkeypatch):
    rows = "0, GPU-aaaa, 81559\n1, GPU-bbbb, 143771\n2, GPU-cccc, 143771"
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, rows) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = config(tmp_path, QWEN_05B, **{"resources.nprocs": 2})
    assert gpu_capacity(cfg) == 81559 * 2**20  # the smaller of GPUs 0 and 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    assert gpu_capacity(cfg) == 143771 * 2**20
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb,0")  # UUIDs count as CUDA reads them
    assert gpu_capacity(cfg) == 81559 * 2**20
    cfg.resources.visible_devices = "1"  # the ranks' own setting wins over this process's
    assert gpu_capacity(cfg) == 143771 * 2**20
    cfg.resources.visible_devices = "-1"
    assert gpu_capacity(cfg) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert gpu_capacity(config(tmp_path, QWEN_05B)) is None  # no nvidia-smi: no figure, no guess


def test_an_8b_full_fine_tune_with_a_critic_on_one_80gb_gpu_is_refused_with_replanned_fixes(tmp_path):
    cfg = config(tmp_path, LLAMA_8B)
    c = Checks()
    check_resources(cfg, c, gpus=1, gpu_bytes=H100, memory_mib=400 << 10)  # a host with 400 GiB free
    (memory,) = [p for p in c.problems if p.where.startswith("memory")]
    error = str(PreflightError(c.problems))
    assert "nothing was started" in error and memory.where in error
    shapes = model_shapes(cfg)
    assert shapes is not None
    plan = memory_plan(cfg, shapes, H100)
    stage, need = plan.peak()
    actor, critic = plan.group("actor"), plan.group("critic")
    assert actor is not None and critic is not None and stage == "update"
    assert f"needs {need / GIB:.1f} GiB per GPU at its peak (update: actor" in memory.found
    assert f"a GPU holds {H100 / GIB:.1f} GiB" in memory.found
    # the fixes in order, each replanned here on a copy with the same settings
    fixes = memory.fix
    order = ["gradient_checkpointing", "ppo_max_token_len_per_gpu", "optimizer_offload", "param_offload"]
    assert [fixes.index(name) for name in order] == sorted(fixes.index(name) for name in order)
    step = cfg.model_copy(deep=True)
    step.model.enable_gradient_checkpointing = True
    recompute = "model.enable_gradient_checkpointing=true (recompute: about a third more update time)"
    assert f"{recompute}: {peak(step) / GIB:.1f} GiB" in fixes
    assert "optimizer_offload=true" in fixes and "no lower, left out" in fixes
    for f in (step.actor.fsdp, step.critic.fsdp, step.ref.fsdp):
        f.param_offload = True
    assert peak(step) <= H100
    assert (
        f"(actor and critic: weights, gradients and moments on the host): {peak(step) / GIB:.1f} GiB - fits"
        in fixes
    )
    best = largest_budget(step, H100, 0.0, ["actor", "critic"])
    assert best is not None and f"actor/critic.ppo_max_token_len_per_gpu up to {best} fits" in fixes
    # the engine cannot start beside 8B weights in float32 either
    (engine,) = [p for p in c.problems if p.where.startswith("rollout.gpu_memory_utilization")]
    assert "vLLM starts only when 0.3 x 79.6 GiB is free" in engine.found
    # a host with 120 GiB free cannot take the offloaded states: LoRA on a bf16 base is the fix
    small_host = Checks()
    check_resources(cfg, small_host, gpus=1, gpu_bytes=H100, memory_mib=120 << 10)
    (memory,) = [p for p in small_host.problems if p.where.startswith("memory")]
    held = memory_plan(step, shapes, H100).host()
    assert f"puts {held / GIB:.1f} GiB in host memory, where 120.0 GiB is free: left out" in memory.fix
    for f in (step.actor.fsdp, step.critic.fsdp, step.ref.fsdp):
        f.param_offload = False
    for section in (step.actor, step.critic):
        section.lora.rank, section.lora.alpha = 32, 64.0
    step.model.use_torch_compile, step.model.dtype = False, "bfloat16"
    assert peak(step) <= H100
    assert f"no compile): {peak(step) / GIB:.1f} GiB - fits" in memory.fix


def test_a_smaller_budget_is_named_by_the_largest_number_that_fits(tmp_path):
    # Qwen2.5-0.5B, 4.6k-token rows, recompute on, 73,728-token update budgets on a 30 GiB GPU
    big = {"actor.ppo_max_token_len_per_gpu": 73728, "critic.ppo_max_token_len_per_gpu": 73728}
    over = {
        "rollout.response_length": 4096,
        "data.train_batch_size": 64,
        "model.enable_gradient_checkpointing": True,
    }
    cfg = config(tmp_path, QWEN_05B, **over, **big)
    c = Checks()
    check_resources(cfg, c, gpus=1, gpu_bytes=30 * GIB)
    (memory,) = c.problems
    assert memory.fix.startswith(
        "cheapest first, each on top of the ones before (the plan's peak after it): (1) "
    )
    budget = int(memory.fix.split("actor/critic.ppo_max_token_len_per_gpu=")[1].split(" ")[0])
    assert budget % BUDGET_STEP == 0 and budget >= 512 + 4096
    trial = cfg.model_copy(deep=True)
    for section in (trial.actor, trial.critic):
        section.ppo_max_token_len_per_gpu = budget
    assert peak(trial, 30 * GIB) <= 30 * GIB
    assert (
        f"=({budget} (the largest that fits): {peak(trial, 30 * GIB) / GIB:.1f} GiB - fits"
        in f"=({budget}" + memory.fix.split(f"={budget}")[1]
    )
    for section in (trial.actor, trial.critic):
        section.ppo_max_token_len_per_gpu = budget + BUDGET_STEP
    assert peak(trial, 30 * GIB) > 30 * GIB


def test_a_config_that_fits_prints_the_plan_and_passes(tmp_path):
    c = Checks()
    check_resources(config(tmp_path, QWEN_05B), c, gpus=1, gpu_bytes=H100)
    assert c.problems == []
    lines = [line for line in c.report.passed if line.startswith("memory plan")]
    assert lines[0].startswith("memory plan (per GPU, GiB): resident per rank actor ")
    assert "stage totals generate" in lines[0] and lines[0].endswith("of 79.6 GiB")
    assert [line.split(":")[1].strip().split(" ")[0] for line in lines[1:]] == ["actor", "critic"]
    cfg = config(tmp_path, QWEN_05B)
    shapes = model_shapes(cfg)
    assert shapes is not None
    plan = memory_plan(cfg, shapes, H100)
    totals = plan.totals()
    assert f"update {totals['update'] / GIB:.1f} of 79.6 GiB" in lines[0]
    for line, group in zip(lines[1:], plan.groups):
        peaks = ", ".join(f"{s} {group.stages[s] / GIB:.1f}" for s in ("generate", "log_probs", "update"))
        assert f"{group.role} rank: peaks {peaks}; largest parts " in line
    skipped = Checks()
    check_memory(config(tmp_path, {"hidden_size": 8}), skipped, H100)  # a config.json without sizes
    assert skipped.problems == [] and skipped.report.notes[0].startswith("memory plan skipped")


def test_auto_budgets_become_the_largest_that_fits_and_set_ones_stay(tmp_path):
    mini = {"actor.ppo_mini_batch_size": 64, "critic.ppo_mini_batch_size": 64}  # 49,152 tokens a step
    cfg = config(tmp_path, QWEN_05B, **mini)
    assert cfg.actor.update_tokens == cfg.critic.update_tokens == 16384  # what the config resolved
    assert "ppo_max_token_len_per_gpu" in given_auto(cfg.actor)
    assert ExperimentConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # the note is not a field
    logged: list[str] = []
    best = refine_auto_budgets(cfg, logged.append, capacity=H100)
    assert best is not None and best % BUDGET_STEP == 0 and best != 16384
    assert cfg.actor.update_tokens == cfg.critic.update_tokens == best
    assert peak(cfg) <= (1 - SPARE) * H100
    for section in (cfg.actor, cfg.critic):
        section.ppo_max_token_len_per_gpu = best + BUDGET_STEP
    assert peak(cfg) > (1 - SPARE) * H100  # the next step up does not fit
    assert (
        logged == [logged[0]]
        and f"ppo_max_token_len_per_gpu auto -> {best} tokens (was 16384, 16384)" in logged[0]
    )
    # with the default mini-batch (16 prompts: 12,288 tokens) memory is not the limit: the budget
    # stops where no pass changes any more, the log-prob pass (twice it) holding the whole batch
    roomy = config(tmp_path, QWEN_05B)
    assert refine_auto_budgets(roomy, logged.append, capacity=H100) == 256 * 768 // 2
    fixed = config(tmp_path, QWEN_05B, **mini, **{"critic.ppo_max_token_len_per_gpu": 8192})
    assert refine_auto_budgets(fixed, logged.append, capacity=H100) is not None
    assert fixed.critic.update_tokens == 8192 and fixed.actor.update_tokens > 8192  # set by hand: kept
    cpu = config(tmp_path, QWEN_05B, **{"resources.device": "cpu"})
    assert refine_auto_budgets(cpu, logged.append, capacity=H100) is None and cpu.actor.update_tokens == 16384
    small = config(tmp_path, QWEN_05B, **mini)
    assert refine_auto_budgets(small, logged.append, capacity=8 * GIB) is None  # not a row fits: unchanged
    assert small.actor.update_tokens == 16384


def test_cpu_ranks_add_the_plan_to_the_measured_runtime(tmp_path):
    over = {"resources.device": "cpu", "resources.nprocs": 2, "rollout.engine": "vllm"}
    cfg = config(tmp_path, QWEN_05B, **over)
    shapes = model_shapes(cfg)
    assert shapes is not None
    runtime = {
        "actor": ACTOR_RANK_MIB << 20,
        "critic": CRITIC_RANK_MIB << 20,
        "reward_model": CRITIC_RANK_MIB << 20,
    }
    need = memory_plan(cfg, shapes, None, runtime).peak()[1]
    assert need > 2 * (ACTOR_RANK_MIB + CRITIC_RANK_MIB) << 20  # more than the runtime alone
    roomy = Checks()
    check_resources(cfg, roomy, cores=2, memory_mib=(need >> 20) + 1)
    assert roomy.problems == [] and any(
        line.startswith("memory plan (host, 2 rank(s)") for line in roomy.report.passed
    )
    tight = Checks()
    check_resources(cfg, tight, cores=2, memory_mib=(need >> 20) - 1024)
    (problem,) = tight.problems
    assert f"need at least {(need >> 20) / 1024:.1f} GiB" in problem.found
    assert (
        "the rank runtime measured on the demo's tiny models + the memory plan's update stage"
        in problem.found
    )
    assert "model.enable_gradient_checkpointing=true" in problem.fix


@pytest.mark.parametrize("shape", [QWEN_05B, LLAMA_8B], ids=["0.5b", "8b"])
def test_the_engine_must_start_beside_the_weights(tmp_path, shape):
    cfg = config(tmp_path, shape, **{"algorithm.adv_estimator": "grpo", "rollout.n": 2})
    c = Checks()
    check_memory(cfg, c, H100)
    starts = [p for p in c.problems if p.where.startswith("rollout.gpu_memory_utilization")]
    shapes = model_shapes(cfg)
    assert shapes is not None
    weights = sum(
        v for g in memory_plan(cfg, shapes, H100).groups for k, v in g.parts.items() if k == "actor weights"
    )
    assert bool(starts) == (H100 - weights - int(2.53 * GIB) < 0.3 * H100)


def test_what_is_offloaded_must_fit_the_host(tmp_path):
    offload = {f"{s}.fsdp.param_offload": True for s in ("actor", "critic")}
    cfg = config(tmp_path, QWEN_05B, **offload)
    shapes = model_shapes(cfg)
    assert shapes is not None
    held = memory_plan(cfg, shapes, H100).host()
    assert held == 4 * 4 * shapes["policy"].params() + 4 * 4 * shapes["critic"].params("value")
    roomy, tight = Checks(), Checks()
    check_resources(cfg, roomy, gpus=1, gpu_bytes=H100, memory_mib=(held >> 20) + 1)
    check_resources(cfg, tight, gpus=1, gpu_bytes=H100, memory_mib=(held >> 20) - 1)
    assert roomy.problems == []
    (problem,) = tight.problems
    assert (
        problem.where == "memory (host)"
        and f"puts {held / GIB:.1f} GiB a GPU in host memory" in problem.found
    )


#: Llama-3.2-3B's published shape (tied embeddings): a student of Llama-3.1-8B (the same tokenizer).
LLAMA_3B = dict(LLAMA_8B, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28)
LLAMA_3B.update(num_attention_heads=24, tie_word_embeddings=True)


def test_a_distillation_teacher_is_planned_on_the_actors_ranks_and_named_in_the_fixes(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps(LLAMA_8B))
    over = {"algorithm.adv_estimator": "distill", "rollout.n": 4, "teacher.model.path": str(teacher)}
    cfg = config(tmp_path, LLAMA_3B, **over)
    alone = config(tmp_path, LLAMA_3B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4})
    shapes = model_shapes(cfg)
    assert shapes is not None and set(shapes) == {"policy", "teacher"}
    plan, without = memory_plan(cfg, shapes, H100), memory_plan(alone, {"policy": shapes["policy"]}, H100)
    actor, base = plan.group("actor"), without.group("actor")
    assert actor is not None and base is not None
    eight_b = 8_030_261_248  # Llama-3.1-8B's parameters
    assert actor.parts["teacher weights"] == 4 * eight_b  # float32 weights, bf16 compute on GPUs
    assert actor.stages["generate"] == base.stages["generate"] + 4 * eight_b  # held in every stage
    assert actor.stages["update"] == base.stages["update"] + 4 * eight_b
    # the log-prob stage: the larger of the actor's forward and the teacher's (8B's activations)
    (forward,) = [v for k, v in actor.parts.items() if k.startswith("teacher forward")]
    assert actor.stages["log_probs"] == actor.resident + forward > base.stages["log_probs"] + 4 * eight_b
    two = memory_plan(config(tmp_path, LLAMA_3B, **over, **{"resources.nprocs": 2}), shapes, H100)
    two_actor = two.group("actor")
    assert two_actor is not None and two_actor.parts["teacher weights"] == 2 * eight_b  # sharded over 2
    offload = config(tmp_path, LLAMA_3B, **over, **{"teacher.fsdp.param_offload": True})
    off = memory_plan(offload, shapes, H100)
    off_actor = off.group("actor")
    assert off_actor is not None and off_actor.parts["host:teacher weights"] == 4 * eight_b
    assert off_actor.stages["update"] == base.stages["update"] and off.host() == 4 * eight_b

    # 3B trained in full beside an 8B teacher does not fit one 80 GB GPU: refused, the teacher's
    # own fixes first (each replanned here on a copy)
    c = Checks()
    check_resources(cfg, c, gpus=1, gpu_bytes=H100, memory_mib=400 << 10)
    (memory,) = [p for p in c.problems if p.where.startswith("memory")]
    print(f"\n3B student, 8B teacher, one 80 GB GPU: {memory.found}\nfixes: {memory.fix}")
    assert f"needs {peak(cfg) / GIB:.1f} GiB per GPU" in memory.found
    step = cfg.model_copy(deep=True)
    assert step.teacher is not None
    step.teacher.model.dtype = "bfloat16"
    assert peak(step) == peak(cfg) - 2 * eight_b
    half = "teacher.model.dtype=bfloat16 (the frozen teacher computes in bfloat16 already: half its weights)"
    assert memory.fix.index(f"{half}: {peak(step) / GIB:.1f} GiB") < memory.fix.index(
        "gradient_checkpointing"
    )
    # on a smaller GPU the chain goes on to parameter offload, the teacher's weights with the actor's
    lines, _ = memory_fixes(cfg, 40 * GIB)
    (offload_line,) = [line for line in lines if "param_offload" in line]
    for f in (step.actor.fsdp, step.teacher.fsdp):
        f.param_offload = True
    step.model.enable_gradient_checkpointing = True
    assert offload_line.startswith(
        f"fsdp.param_offload=true (actor and teacher: weights, gradients and moments on the host): "
        f"{peak(step, 40 * GIB) / GIB:.1f} GiB - fits"
    )
