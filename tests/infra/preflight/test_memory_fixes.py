"""The fixes of a config that does not fit (``ppoflow.infra.preflight.memory_fixes``): each line's
figure is the plan of the settings so far, set here by hand on a copy and planned again; a fix
that lowers nothing is said and left out of what follows; the chain stops at the first that fits."""

from __future__ import annotations

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.preflight.memory_fixes import LORA_RANK, memory_fixes, model_shapes
from ppoflow.infra.preflight.memory_plan import GIB, memory_plan
from tests.infra.preflight.test_memory_check import config
from tests.infra.preflight.test_model_shape import LLAMA_8B, QWEN_05B


def planned(cfg: ExperimentConfig, capacity: int) -> str:
    shapes = model_shapes(cfg)
    assert shapes is not None
    return f"{memory_plan(cfg, shapes, capacity).peak()[1] / GIB:.1f} GiB"


def test_every_fix_is_replanned_and_a_useless_one_is_left_out(tmp_path):
    cfg = config(tmp_path, LLAMA_8B, **{"rollout.n": 4})
    gpu = 24 * GIB  # too small for an 8B policy whatever is tried
    lines, fits = memory_fixes(cfg, gpu)
    assert not fits and len(lines) == 6
    trial = cfg.model_copy(deep=True)
    trial.model.enable_gradient_checkpointing = True
    assert (
        lines[0]
        == f"model.enable_gradient_checkpointing=true (recompute: about a third more update time): {planned(trial, gpu)}"
    )
    one_row = trial.model_copy(deep=True)
    for section in (one_row.actor, one_row.critic):
        section.ppo_max_token_len_per_gpu = 768
    assert lines[1].endswith(f"one row a micro-batch still needs {planned(one_row, gpu)}")
    assert lines[2].startswith("fsdp.optimizer_offload=true") and lines[2].endswith("no lower, left out")
    for fsdp in (trial.actor.fsdp, trial.critic.fsdp, trial.ref.fsdp):
        fsdp.param_offload = True  # the optimizer offload is not in it: it was left out
    assert lines[3].endswith(f"weights, gradients and moments on the host): {planned(trial, gpu)}")
    assert (
        lines[4]
        == f"actor.lora.rank={LORA_RANK} (and critic.lora; model.dtype=bfloat16: nothing of the base is trained; no compile): no lower, left out"
    )
    trial.critic.enable = False
    trial.algorithm.adv_estimator = "grpo"
    assert lines[5] == f"algorithm.adv_estimator=grpo (no critic; rollout.n >= 2): {planned(trial, gpu)}"


def test_the_chain_stops_at_the_first_fix_that_fits(tmp_path):
    cfg = config(tmp_path, QWEN_05B, **{"rollout.response_length": 8192, "data.train_batch_size": 64})
    lines, fits = memory_fixes(cfg, 40 * GIB)
    assert fits and len(lines) == 1 and lines[0].startswith("model.enable_gradient_checkpointing=true")
    assert " - fits; with it, actor/critic.ppo_max_token_len_per_gpu up to " in lines[0]
    lora = config(tmp_path, LLAMA_8B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4})
    lines, fits = memory_fixes(lora, 80 * GIB)
    assert fits and lines[-1].startswith("fsdp.param_offload=true (actor: weights")
