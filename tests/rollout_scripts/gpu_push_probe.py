"""GPU probe of the trainer side of a weight push (no vLLM needed): torchrun on N GPUs.

The GPU machines have no vLLM, so a real push cannot be timed there. This measures the parts of a
push that do not depend on vLLM, on an FSDP2 bf16 Qwen2-shaped model with random weights:

- ``gather``: the hf_weight_loader stream, ``full_tensor()`` of one parameter at a time (NCCL
  all-gather per parameter), as ``iter_full_params`` does;
- ``gather+load``: the same plus what vLLM's in-place reload does per tensor on GPU: narrow to the
  rank's TP slice, copy into a freshly materialised layer tensor, then copy that into the kernel
  tensor (two device copies of the slice; unquantized GPU layers need no repacking);
- ``sliced``: each rank receives only its TP slice (``all_to_all_single`` from the FSDP shards),
  then the same two copies — the dtensor_weight_loader path.

    torchrun --nproc-per-node=2 tests/rollout_scripts/gpu_push_probe.py --model 1.5b

Prints one JSON line per mode from rank 0 (seconds, seconds per billion parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

SHAPES = {  # Qwen2.5 shapes
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


def build(shape: str, device: torch.device):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def tp_slice(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The rank's TP slice, as vLLM's loaders narrow it (column: dim 0, row: dim 1, else full)."""
    if tp == 1:
        return full
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return full.chunk(tp, 0)[rank % tp]
    if any(k in name for k in ("o_proj.weight", "down_proj.weight")):
        return full.chunk(tp, 1)[rank % tp]
    return full


def engine_copy(name: str, t: torch.Tensor, kernel: dict) -> None:
    """Two device copies of the slice: into a fresh materialised tensor, then into the kernel tensor."""
    fresh = torch.empty_like(t)
    fresh.copy_(t)
    if name not in kernel:
        kernel[name] = torch.empty_like(t)
    kernel[name].copy_(fresh)


def sliced(param, tp: int, name: str) -> torch.Tensor:
    """This rank's TP slice from the Shard(0) FSDP parameter by all_to_all_single (dim-0 slices) or
    full_tensor (others)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dim = (
        0
        if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
        else (1 if any(k in name for k in ("o_proj.weight", "down_proj.weight")) else None)
    )
    if tp == 1 or dim is None or tp != world:
        return param.full_tensor()
    from torch.distributed.tensor import Shard

    if dim == 0:  # FSDP Shard(0) == TP column split when TP == FSDP world and rows divide
        return param.to_local() if param.shape[0] % world == 0 else param.full_tensor().chunk(tp, 0)[rank]
    return param.redistribute(param.device_mesh, [Shard(1)]).to_local()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build(args.model, device)
    n_params = sum(p.numel() for p in model.parameters())
    kernel: dict = {}
    results = []
    for mode in ("gather", "gather+load", "sliced"):
        times = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for name, param in model.named_parameters():
                t = sliced(param, world, name) if mode == "sliced" else param.full_tensor()
                if mode != "gather":
                    engine_copy(name, tp_slice(name, t, world, rank) if mode == "gather+load" else t, kernel)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times[1:])
        results.append(
            {
                "model": args.model,
                "params": n_params,
                "ranks": world,
                "tp": world,
                "mode": mode,
                "s": round(best, 4),
                "s_per_Bparam": round(best / (n_params / 1e9), 4),
            }
        )
    if rank == 0:
        for r in results:
            print(json.dumps(r), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
