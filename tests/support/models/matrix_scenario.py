"""One row of the model matrix end to end on two CPU ranks (gloo, fp32 trainer): one worker group,
the production ``ActorRolloutRefWorker`` (tests/support/models/matrix_worker.py), vLLM's CPU engine
with tensor parallelism 2 (one engine over both ranks) where the row has it.

:func:`run_row` runs, in this order, and records what it saw:

1. ``generate_sequences``: the first push (live weights through the dtensor loader with TP 2),
   a sampled rollout, the trainer's log-probs of the sampled tokens;
2. ``update_actor``: one PPO step (AdamW, a large learning rate: every weight moves);
3. ``generate_sequences`` again: the push of the updated weights, the same comparison, and the
   trainer's log-probs of step 1's tokens now (how far the update moved them: what a stale engine
   would be off by);
4. ``packing_check``: loss, log-probs and gradients padded / packed / sequence parallel;
5. ``save_checkpoint`` (weights); with LoRA: one update of a LoRA policy and a rollout from its
   merged weights; then ``load_policy`` of the checkpoint (a push from DCP through the hf loader,
   over whatever the engine held) and a last rollout;
6. in this process: ``export_hf`` of the checkpoint, reloaded with transformers, its log-probs of
   step 5's tokens against the trainer's.

References: the engine against the trainer (two implementations), the export against the trainer
(transformers' own forward), packed against padded.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

WORKER = "tests.support.models.matrix_worker:MatrixWorker"
P, R = 64, 16  # prompts up to 60 tokens + 16: longer than the tiny sliding window (32)
PROMPTS = [5, 33, 47, 60]


def prompts(seed: int = 0):
    """Left-padded random prompts (ids 5..199)."""
    from ppoflow.infra.data.dataproto import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(PROMPTS), P), 1, dtype=torch.long)
    mask = torch.zeros((len(PROMPTS), P), dtype=torch.long)
    for i, n in enumerate(PROMPTS):
        ids[i, P - n :] = torch.randint(5, 200, (n,), generator=g)
        mask[i, P - n :] = 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"uid": [f"p{i}" for i in range(len(PROMPTS))]},
    )


def experiment(row, model_dir: str, work: str) -> dict[str, Any]:
    tp = 2 if row.tensor_parallel else 1
    return {
        "model": {"path": model_dir, "dtype": "float32"},
        "data": {"train_files": ["unused.parquet"], "train_batch_size": len(PROMPTS)},
        "resources": {"nprocs": 2, "device": "cpu"},
        "rollout": {
            "engine": row.cpu_engine,
            "dtype": row.cpu_engine_dtype,
            "tensor_model_parallel_size": tp,
            "weight_loader": "dtensor" if tp > 1 else "hf",
            "prompt_length": P,
            "response_length": R,
            "kv_cache_gib": 0.0625,
            "max_num_seqs": 8,
            "calculate_log_probs": True,
        },
        "actor": {
            "optim": {"lr": 0.02, "weight_decay": 0.0, "grad_clip": 1e9},
            "ppo_mini_batch_size": len(PROMPTS),
            "ppo_micro_batch_size_per_gpu": 2,
            "log_prob_micro_batch_size_per_gpu": 4,
            "use_dynamic_bsz": row.packing,
            "ppo_max_token_len_per_gpu": 4 * (P + R),
            "logprob_chunk_size": 16,  # several chunks per micro-batch: the chunked head's seam
        },
        "critic": {"ppo_mini_batch_size": len(PROMPTS)},
        "storage": {"root": work, "experiment": "matrix"},
    }


def _call(group, work: str, method: str, data, name: str, **meta):
    """``method`` on ``data`` (with ``meta`` in its meta_info: a rollout's ``seed``)."""
    from ppoflow.infra.data.dataproto import DataProto

    url = os.path.join(work, f"{name}-in.arrow")
    data.meta_info.update(meta)
    data.save(url)
    return DataProto.load(group.call(method, url, out_url=os.path.join(work, f"{name}-out.arrow")))


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


def _with_advantages(out, seed: int):
    """``out`` with a +-1 advantage per row (the PPO update's input)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (len(out), 1), generator=g).float() * 2 - 1
    out.batch["advantages"] = sign * out.batch["response_mask"].float()
    return out


def _engine_record(out) -> dict[str, float]:
    from ppoflow.algos.mismatch import mismatch_metrics

    mask = out.batch["response_mask"]
    m = mismatch_metrics(out.batch["old_log_probs"], out.batch["rollout_log_probs"], mask)
    return {
        "max_abs": m["abs_log_ratio_max"],
        "token_mult_prob_error": m["token_mult_prob_error"],
        "tokens": m["tokens"],
    }


class _Clock:
    """Seconds since the previous tick, by phase name."""

    def __init__(self, into: dict[str, float]):
        self.into, self.last = into, time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = round(now - self.last, 1)
        self.last = now


def run_row(row, work: str) -> dict[str, Any]:
    """The scenario of the module docstring for one row; returns what the test asserts on."""
    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.infra.remote.driver.group import WorkerGroup

    t0 = time.perf_counter()
    model_dir = save_tiny_model(os.path.join(work, "model"), arch=row.name)
    config = {"config": experiment(row, model_dir, work), "role": "actor_rollout", "lora": row.lora}
    config.update(sp=row.sequence_parallel, lora_targets=list(row.lora_targets or []))
    rec: dict[str, Any] = {"lines": [], "seconds": {}}
    ckpt = os.path.join(work, "ckpt")
    clock = _Clock(rec["seconds"])
    with WorkerGroup(WORKER, nprocs=2, config=config, log=rec["lines"].append) as g:
        clock("start")
        rec["init"] = g.call("init_model")
        clock("init_model")
        first = _call(g, work, "generate_sequences", prompts(), "first", seed=1)
        rec["first"] = _engine_record(first)
        data = os.path.join(work, "update.arrow")
        _with_advantages(first, 0).save(data)
        rec["update"] = g.call("update_actor", data)[0]
        second = _call(g, work, "generate_sequences", prompts(), "second", seed=2)
        rec["second"] = _engine_record(second)
        moved = _call(g, work, "compute_log_prob", first, "moved")
        rec["moved"] = _gap(
            moved.batch["old_log_probs"], first.batch["old_log_probs"], first.batch["response_mask"]
        )
        clock("pushes_and_update")
        rec["packing"] = g.call("packing_check", 0)[0]
        clock("packing_check")
        g.call("save_checkpoint", ckpt, weights_only=True)
        if row.lora:
            rec["lora_update"] = g.call("lora_update", data)[0]
            rec["lora"] = _engine_record(_call(g, work, "lora_generate", prompts(), "lora", seed=3))
        g.call("load_policy", ckpt)
        last = _call(g, work, "generate_sequences", prompts(), "last", seed=4)
        rec["checkpoint"] = _engine_record(last)
        clock("checkpoint_and_lora")
    clock("shutdown")
    rec["export"] = export_gap(ckpt, model_dir, os.path.join(work, "export"), last)
    clock("export")
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def export_gap(ckpt: str, model_dir: str, out_dir: str, rollout) -> dict[str, Any]:
    """``export_hf`` of the checkpoint, loaded by transformers: its log-probs of the rollout's
    tokens against the trainer's (``old_log_probs``), and the exported weights' file names."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from ppoflow.infra.checkpoint.hf_export import export_hf

    export_hf(ckpt, out_dir, model_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    mask = rollout.batch["response_mask"]
    got = torch.zeros_like(rollout.batch["old_log_probs"])
    with torch.no_grad():
        for i in range(len(rollout)):
            keep = rollout.batch["attention_mask"][i].bool()
            ids = rollout.batch["input_ids"][i][keep].unsqueeze(0)
            n = int(mask[i].sum())
            logits = model(ids).logits[0, -n - 1 : -1].float().log_softmax(-1)
            got[i, :n] = logits.gather(-1, ids[0, -n:].unsqueeze(-1)).squeeze(-1)
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        base_names = sorted(f.keys())
    return {"max_abs": _gap(got, rollout.batch["old_log_probs"], mask), "same_names": names == base_names}
