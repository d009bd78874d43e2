"""Manual GPU check of ppoflow.infra.checkpoint.sharded (not part of pytest): NCCL ranks, CUDA tensors and RNG.

    PYTHONPATH=. torchrun --nproc-per-node=2 tests/gpu/checkpoint_check.py OUT_DIR

Each rank: tiny model under FSDP2 on cuda, one AdamW step, save, a reference second step, load
(same world size: model, optimizer, CUDA + CPU RNG back), the second step again; then a background
save (pinned host staging, an own gloo group) while the second step runs, loaded into a fresh
model; prints the differences (deterministic algorithms on, so they should be 0) and the times.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ppoflow.infra.checkpoint.sharded import load_checkpoint, load_full_state_dict, save_checkpoint
from ppoflow.infra.checkpoint.writer import CheckpointWriter
from tests.support.ckpt.common import batch, full_params, make_optim, max_diff


def step(model, opt, sched, k, rank, world):
    ids = batch(k)
    per = ids.shape[0] // world
    ids = ids[rank * per : (rank + 1) * per].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    out = sys.argv[1]
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import save_tiny_model

    base = os.path.join(out, "base")
    if rank == 0:
        save_tiny_model(base)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(base).cuda()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    step(model, opt, sched, 1, rank, world)
    w1 = full_params(model)
    res: dict = {"world": world, "device": torch.cuda.get_device_name()}
    t0 = time.perf_counter()
    save_checkpoint(os.path.join(out, "c"), model, opt, sched, extra={"iteration": 1})
    res["save_s"] = round(time.perf_counter() - t0, 3)
    rand = (torch.rand(4, device="cuda").cpu(), torch.rand(4))
    step(model, opt, sched, 2, rank, world)
    ref2 = full_params(model)
    t0 = time.perf_counter()
    res["extra"] = load_checkpoint(os.path.join(out, "c"), model, opt, sched)
    res["load_s"] = round(time.perf_counter() - t0, 3)
    res["rng_restored"] = bool(
        torch.equal(torch.rand(4, device="cuda").cpu(), rand[0]) and torch.equal(torch.rand(4), rand[1])
    )
    res["w_after_load"] = max_diff(
        {k: v.cpu() for k, v in full_params(model).items()}, {k: v.cpu() for k, v in w1.items()}
    )
    step(model, opt, sched, 2, rank, world)
    res["step_after_load"] = max_diff(
        {k: v.cpu() for k, v in full_params(model).items()}, {k: v.cpu() for k, v in ref2.items()}
    )
    full = load_full_state_dict(os.path.join(out, "c"))
    res["full_state_dict"] = max_diff(full, {k: v.cpu() for k, v in w1.items()})

    # background save of the state after step 1 while step 2 runs on the live tensors
    load_checkpoint(os.path.join(out, "c"), model, opt, sched)
    writer = CheckpointWriter()
    t0 = time.perf_counter()
    res["async_staged_s"] = round(
        writer.save(os.path.join(out, "ca"), model, opt, sched, background=True)["staged_s"], 4
    )
    step(model, opt, sched, 2, rank, world)
    res["async_step_while_writing"] = max_diff(
        {k: v.cpu() for k, v in full_params(model).items()}, {k: v.cpu() for k, v in ref2.items()}
    )
    res["async_write_s"] = round(writer.wait()["write_s"], 3)
    writer.close()
    load_checkpoint(os.path.join(out, "ca"), model, opt, sched)
    res["async_w_after_load"] = max_diff(
        {k: v.cpu() for k, v in full_params(model).items()}, {k: v.cpu() for k, v in w1.items()}
    )
    step(model, opt, sched, 2, rank, world)
    res["async_step_after_load"] = max_diff(
        {k: v.cpu() for k, v in full_params(model).items()}, {k: v.cpu() for k, v in ref2.items()}
    )
    print(f"[rank {rank}] " + json.dumps(res), flush=True)
    del model, opt, sched
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
