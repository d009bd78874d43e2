"""Setup for benchmarks/actor_update.py: process group, the Qwen2 policy under FSDP2 as the actor
worker builds it, and a synthetic rollout. Plain namespaces stand in for the config sections, so
the benchmark runs without pydantic (the GPU machine's Python has none)."""

from __future__ import annotations

import argparse
import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.actor import DataParallelPPOActor
from ppoflow.workers.compiled import compile_decoder_layers
from ppoflow.workers.fsdp_utils import apply_fsdp, build_mesh
from ppoflow.workers.hf_models import enable_gradient_checkpointing, model_from_config
from ppoflow.workers.modeling import PolicyLM
from ppoflow.workers.optim import build_optimizer
from ppoflow.workers.packing import use_varlen_attention

QWEN25_05B = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=256,
    vocab_size=512,
    tie_word_embeddings=True,
    max_position_embeddings=256,
)


def init_distributed(device: str, threads: int) -> tuple[int, int, torch.device]:
    """torchrun's env, or a one-rank group of our own; NCCL on cuda, gloo on cpu (``threads`` each)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(threads)
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), dev


def configs(args: argparse.Namespace, point: dict) -> tuple[SimpleNamespace, SimpleNamespace]:
    """Actor and FSDP settings with the fields of ``ppoflow.infra.config.ActorConfig`` / ``FSDPConfig``
    (plain namespaces, so the benchmark runs without pydantic)."""
    kind, size = point["batching"]
    optim = SimpleNamespace(
        lr=1e-6,
        betas=(0.9, 0.999),
        weight_decay=0.01,
        eps=1e-8,
        warmup_steps=0,
        warmup_steps_ratio=0.0,
        total_training_steps=None,
        grad_clip=1.0,
        fused=point["optim"] == "fused",
    )
    fsdp = SimpleNamespace(
        fsdp_size=-1,
        param_dtype=None if args.param_dtype == "none" else args.param_dtype,
        reduce_dtype="float32",
        param_offload=False,
        optimizer_offload=False,
        reshard_after_forward=point["reshard"],
    )
    actor = SimpleNamespace(
        ppo_mini_batch_size=args.mini_batch,
        ppo_micro_batch_size_per_gpu=size if kind == "rows" else 1,
        ppo_epochs=1,
        shuffle=False,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        entropy_coeff=0.0,
        use_kl_loss=args.kl_loss,
        kl_loss_coef=0.001,
        kl_loss_type="low_var_kl",
        log_prob_micro_batch_size_per_gpu=args.log_prob_micro_batch,
        use_dynamic_bsz=kind == "tokens",
        ppo_max_token_len_per_gpu=size if kind == "tokens" else 16384,
        log_prob_max_token_len_per_gpu=None,
        optim=optim,
        fsdp=fsdp,
    )
    return actor, fsdp


def build_actor(
    args: argparse.Namespace, point: dict, world: int, device: torch.device
) -> tuple[DataParallelPPOActor, int, object]:
    """Random Qwen2 policy -> PolicyLM -> FSDP2 -> DataParallelPPOActor; returns (actor, N, hf config)."""
    from transformers import Qwen2Config

    hf_cfg = Qwen2Config(**(TINY if args.tiny else QWEN25_05B), use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        hf = model_from_config(hf_cfg, "causal_lm", dtype=args.master_dtype)
    actor_cfg, fsdp_cfg = configs(args, point)
    if actor_cfg.use_dynamic_bsz:
        use_varlen_attention(hf)
    if point["recompute"]:
        enable_gradient_checkpointing(hf)
    if point["compile"]:
        compile_decoder_layers(hf)
    n_params = sum(p.numel() for p in hf.parameters())
    module = apply_fsdp(
        PolicyLM(hf, chunk_size=args.chunk_size, head_impl=point["head"], compiled_head=point["compile"]),
        build_mesh(fsdp_cfg, world, device.type),
        fsdp_cfg,
        device,
    )
    optimizer, scheduler = build_optimizer(module, actor_cfg.optim)
    if point["optim"] != "fused":  # torch's multi-tensor (foreach) or per-parameter kernels
        for group in optimizer.param_groups:
            group["foreach"] = point["optim"] == "foreach"
    actor = DataParallelPPOActor(
        actor_cfg, module, optimizer, scheduler, rollout_n=1, dp_size=world, device=device
    )
    return actor, n_params, hf_cfg


def synthetic_rollout(
    rows: int, prompt_len: int, response_len: int, vocab: int, lengths: str, seed: int
) -> DataProto:
    """Left-padded prompts, right-padded responses, random tokens and advantages. ``full``: no
    padding; ``uneven``: prompt lengths uniform in [1, P], response lengths in [1, R]."""
    g = torch.Generator().manual_seed(seed)
    total = prompt_len + response_len
    ids = torch.randint(0, vocab, (rows, total), generator=g)
    if lengths == "full":
        p_len = torch.full((rows,), prompt_len)
        r_len = torch.full((rows,), response_len)
    else:
        p_len = torch.randint(1, prompt_len + 1, (rows,), generator=g)
        r_len = torch.randint(1, response_len + 1, (rows,), generator=g)
    col = torch.arange(total)
    attn = ((col >= prompt_len - p_len[:, None]) & (col < prompt_len + r_len[:, None])).long()
    batch = {
        "input_ids": ids * attn,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": (ids * attn)[:, prompt_len:].clone(),
        "response_mask": attn[:, prompt_len:].clone(),
        "advantages": torch.randn(rows, response_len, generator=g) * attn[:, prompt_len:],
    }
    return DataProto.from_dict(batch, meta_info={"temperature": 1.0})
