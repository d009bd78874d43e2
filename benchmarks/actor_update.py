"""Actor-update throughput: ``DataParallelPPOActor.update_policy`` on a Qwen2.5-0.5B-shaped policy.

Random weights, synthetic rollout (every token real: no padding), FSDP2 on one rank (or more with
torchrun: the sequences are split over the ranks). Prints tokens/s and MFU.

    python benchmarks/actor_update.py                                   # H200: 256 x (512 + 256), bf16
    python benchmarks/actor_update.py --micro-batch 16 --recompute off
    python benchmarks/actor_update.py --micro-batch 8,16,32 --recompute on,off --head checkpoint,fused
    torchrun --nproc-per-node=1 benchmarks/actor_update.py --micro-batch 8 --recompute on
    python benchmarks/actor_update.py --tiny --device cpu               # a smoke run on a CPU

``--micro-batch``, ``--recompute`` and ``--head`` take comma lists: every combination runs in one
process (one row each; a combination that runs out of GPU memory prints ``OOM`` and the sweep
goes on). ``--head``: how PolicyLM's chunked LM head recomputes its logits in backward
(``checkpoint``: activation checkpointing, the default in ppoflow; ``fused``: hand-written backward).

MFU = model FLOPs / time / (peak x ranks), with peak 791 TFLOP/s (H200 bf16 dense, measured):
- ``mfu``: the usual count, 6·N·tokens (8·N·tokens with activation recomputation);
- ``mfu_useful``: only the matmuls the step needs: 6·(N - V·H)·tokens + 6·V·H·response_tokens
  (PolicyLM applies the LM head to response positions only), no recomputation counted.
``logprob`` rows time ``compute_log_prob`` (forward only: 2·N·tokens).

Defaults: fp32 master weights with bf16 compute (FSDP ``MixedPrecisionPolicy(bf16, fp32)``), as
ppoflow recommends on GPUs; ``--master-dtype bfloat16`` trains pure bf16. Needs torch, transformers,
numpy, pyarrow, fsspec (``ppoflow.infra.data.dataproto``); not pydantic, vLLM or Prefect.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.actor import DataParallelPPOActor
from ppoflow.workers.fsdp_utils import (
    apply_fsdp,
    build_mesh,
    build_optimizer,
    enable_gradient_checkpointing,
    model_from_config,
)
from ppoflow.workers.modeling import HEAD_IMPLS, PolicyLM

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tiny", action="store_true", help="tiny model and batch (with --device cpu: a smoke test)"
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--sequences", type=int, help="rollout rows (all ranks); default 256 (tiny: 8)")
    p.add_argument("--prompt-len", type=int, help="default 512 (tiny: 32)")
    p.add_argument("--response-len", type=int, help="default 256 (tiny: 16)")
    p.add_argument(
        "--mini-batch", type=int, help="sequences per optimizer step (all ranks); default 64 (tiny: 4)"
    )
    p.add_argument(
        "--micro-batch", default=None, help="sequences per forward/backward, comma list; default 8 (tiny: 2)"
    )
    p.add_argument("--log-prob-micro-batch", type=int, default=None, help="default 16 (tiny: 4)")
    p.add_argument(
        "--recompute", default="on", help="activation checkpointing of each decoder layer: on, off or on,off"
    )
    p.add_argument(
        "--head", default="checkpoint", help="LM-head backward: checkpoint, fused or checkpoint,fused"
    )
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per log-prob chunk of the LM head")
    p.add_argument("--master-dtype", default=None, help="parameter dtype; default float32")
    p.add_argument(
        "--param-dtype",
        default=None,
        help="FSDP compute dtype ('none' = the master dtype); default bfloat16 on cuda, none on cpu",
    )
    p.add_argument(
        "--no-reshard", action="store_true", help="reshard_after_forward=False (saves all-gathers)"
    )
    p.add_argument("--kl-loss", action="store_true", help="add the low-var KL loss against a reference")
    p.add_argument("--warmup", type=int, default=1, help="untimed update_policy calls")
    p.add_argument("--iters", type=int, default=2, help="timed update_policy calls")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per rank on --device cpu (more than free cores makes each op far slower)",
    )
    p.add_argument("--peak-tflops", type=float, default=791.0, help="per-device peak for MFU")
    args = p.parse_args(argv)
    tiny = args.tiny
    for name, big, small in (
        ("sequences", 256, 8),
        ("prompt_len", 512, 32),
        ("response_len", 256, 16),
        ("mini_batch", 64, 4),
        ("micro_batch", 8, 2),
        ("log_prob_micro_batch", 16, 4),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else big)
    args.micro_batches = [int(x) for x in str(args.micro_batch).split(",")]
    args.recomputes = [{"on": True, "off": False}[x.strip()] for x in args.recompute.split(",")]
    args.heads = [x.strip() for x in args.head.split(",")]
    if any(h not in HEAD_IMPLS for h in args.heads):
        p.error(f"--head must be in {HEAD_IMPLS}")
    args.master_dtype = args.master_dtype or "float32"
    if args.param_dtype is None:
        args.param_dtype = "bfloat16" if args.device == "cuda" else "none"
    return args


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


def configs(args: argparse.Namespace, micro_batch: int) -> tuple[SimpleNamespace, SimpleNamespace]:
    """Actor and FSDP settings with the fields of ``ppoflow.infra.config.ActorConfig`` / ``FSDPConfig``
    (plain namespaces, so the benchmark runs without pydantic)."""
    optim = SimpleNamespace(
        lr=1e-6,
        betas=(0.9, 0.999),
        weight_decay=0.01,
        eps=1e-8,
        warmup_steps=0,
        warmup_steps_ratio=0.0,
        total_training_steps=None,
        grad_clip=1.0,
    )
    fsdp = SimpleNamespace(
        fsdp_size=-1,
        param_dtype=None if args.param_dtype == "none" else args.param_dtype,
        reduce_dtype="float32",
        param_offload=False,
        optimizer_offload=False,
        reshard_after_forward=not args.no_reshard,
    )
    actor = SimpleNamespace(
        ppo_mini_batch_size=args.mini_batch,
        ppo_micro_batch_size_per_gpu=micro_batch,
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
    if point["recompute"]:
        enable_gradient_checkpointing(hf)
    n_params = sum(p.numel() for p in hf.parameters())
    actor_cfg, fsdp_cfg = configs(args, point["micro_batch"])
    module = apply_fsdp(
        PolicyLM(hf, chunk_size=args.chunk_size, head_impl=point["head"]),
        build_mesh(fsdp_cfg, world, device.type),
        fsdp_cfg,
        device,
    )
    optimizer, scheduler = build_optimizer(module, actor_cfg.optim)
    actor = DataParallelPPOActor(
        actor_cfg, module, optimizer, scheduler, rollout_n=1, dp_size=world, device=device
    )
    return actor, n_params, hf_cfg


def synthetic_rollout(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> DataProto:
    """Full-length prompts and responses (no padding), random tokens and advantages."""
    g = torch.Generator().manual_seed(seed)
    total = prompt_len + response_len
    ids = torch.randint(0, vocab, (rows, total), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, total, dtype=torch.long),
        "position_ids": torch.arange(total).expand(rows, total).clone(),
        "responses": ids[:, prompt_len:].clone(),
        "response_mask": torch.ones(rows, response_len, dtype=torch.long),
        "advantages": torch.randn(rows, response_len, generator=g),
    }
    return DataProto.from_dict(batch, meta_info={"temperature": 1.0})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Seconds of one call (device synchronised before and after), and its result."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def run_point(args: argparse.Namespace, point: dict, world: int, rank: int, device: torch.device) -> dict:
    """Build the actor for one (micro-batch, recompute, head) combination, time compute_log_prob
    and update_policy, return the row of results."""
    actor, n_params, hf_cfg = build_actor(args, point, world, device)
    rows = args.sequences // world
    data = synthetic_rollout(rows, args.prompt_len, args.response_len, hf_cfg.vocab_size, seed=rank)
    # compute_log_prob: the first call warms up, the second is timed; its output is the "old" policy
    actor.compute_log_prob(data[: min(rows, args.log_prob_micro_batch)])
    lp_s, (old, _) = timed(lambda: actor.compute_log_prob(data), device)
    data.batch["old_log_probs"] = old + 0.01 * torch.randn(
        old.shape, generator=torch.Generator().manual_seed(1)
    )
    if args.kl_loss:
        data.batch["ref_log_prob"] = old.clone()
    for _ in range(args.warmup):
        actor.update_policy(data)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        seconds, metrics = timed(lambda: actor.update_policy(data), device)
        times.append(seconds)
    step_s = sum(times) / len(times)

    tokens = args.sequences * (args.prompt_len + args.response_len)
    head = hf_cfg.vocab_size * hf_cfg.hidden_size
    peak = args.peak_tflops * 1e12 * world
    flops = (8 if point["recompute"] else 6) * n_params * tokens
    useful = 6 * (n_params - head) * tokens + 6 * head * args.sequences * args.response_len
    return {
        **point,
        "params_M": round(n_params / 1e6, 1),
        "update_s": round(step_s, 4),
        "update_tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(flops / step_s / peak, 4),
        "mfu_formula": "8N" if point["recompute"] else "6N",
        "mfu_useful": round(useful / step_s / peak, 4),
        "logprob_s": round(lp_s, 4),
        "logprob_tokens_per_s": round(tokens / lp_s, 1),
        "logprob_mfu": round(2 * n_params * tokens / lp_s / peak, 4),
        "optimizer_steps": metrics["actor/optimizer_steps"],
        "grad_norm": round(metrics["actor/grad_norm"], 4),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }


def _row(r: dict) -> str:
    """One table line of a result (or of an OOM)."""
    head = f"{r['micro_batch']:>5} {str(r['recompute']):>6} {r['head']:>10}"
    if "error" in r:
        return f"{head} {r['error']}"
    return (
        f"{head} {r['update_s']:>9.3f} {r['update_tokens_per_s']:>10.0f} {r['mfu']:>6.3f} "
        f"{r['mfu_useful']:>6.3f} | {r['logprob_tokens_per_s']:>13.0f} {r['logprob_mfu']:>6.3f} | "
        f"{r['peak_mem_GiB']!s:>8}"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rank, world, device = init_distributed(args.device, args.threads)
    if args.sequences % world or args.mini_batch % world:
        raise SystemExit(
            f"--sequences {args.sequences} and --mini-batch {args.mini_batch} must divide by {world} ranks"
        )
    setup = {
        "model": "tiny" if args.tiny else "qwen2.5-0.5b-shape",
        "ranks": world,
        "device": args.device,
        "master_dtype": args.master_dtype,
        "param_dtype": args.param_dtype,
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "mini_batch": args.mini_batch,
        "chunk_size": args.chunk_size,
        "reshard_after_forward": not args.no_reshard,
    }
    if rank == 0:
        print(
            f"actor update: {setup['model']}, {world} rank(s) on {args.device}, master {args.master_dtype}, "
            f"compute {args.param_dtype}, {args.sequences} x ({args.prompt_len} + {args.response_len}) tokens, "
            f"mini-batch {args.mini_batch}, head chunk {args.chunk_size}"
        )
        print(
            f"{'micro':>5} {'recomp':>6} {'head':>10} {'update s':>9} {'tok/s':>10} {'MFU':>6} "
            f"{'useful':>6} | {'logprob tok/s':>13} {'MFU':>6} | {'peak GiB':>8}",
            flush=True,
        )
    results = []
    for micro in args.micro_batches:
        for recompute in args.recomputes:
            for head in args.heads:
                point = {"micro_batch": micro, "recompute": recompute, "head": head}
                try:
                    result = {**setup, **run_point(args, point, world, rank, device)}
                except torch.cuda.OutOfMemoryError:
                    result = {**setup, **point, "error": "OOM"}
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                results.append(result)
                if rank == 0:
                    print(_row(result), flush=True)
    if rank == 0:
        for result in results:
            print("RESULT " + json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
