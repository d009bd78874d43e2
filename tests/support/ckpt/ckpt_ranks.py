"""torchrun script for tests/infra/checkpoint/test_checkpoints.py: real gloo ranks saving and loading checkpoints.

    torchrun --nproc-per-node=2 ckpt_ranks.py save WORK     # 1-D FSDP over 2 ranks
    torchrun --nproc-per-node=4 ckpt_ranks.py hsdp WORK     # 2x2 (replicate, shard) mesh
    torchrun --nproc-per-node=2 ckpt_ranks.py async WORK    # background saves (after ``save``)
    torchrun --nproc-per-node=2 ckpt_ranks.py killed WORK   # PPOFLOW_FAULT kills rank 1 mid-write

WORK holds ``base/`` (the tiny HF model) and ``c1/`` (a checkpoint saved by one plain process after
step 1). Mode ``save`` writes ``c2/`` (2 ranks, after step 1), the reference tensors ``w1``
(weights after step 1), ``ref2`` (after an uninterrupted step 2) and ``logits`` of batch 9 after
step 1, then checks 2->2 (RNG restored, bit-exact continuation), 1->2, and S3 when CKPT_S3_URL is
set. Mode ``hsdp`` loads ``c2/`` into a 2x2 mesh (2->4), continues one step and saves ``c4/``.
Mode ``async`` saves in the background (``CheckpointWriter``) while training goes on: ``ca/``
after step 1 (the live weights change during the write), ``cb/`` + ``cc/`` back to back with two
writer threads per rank, ``cd/``
with one injected storage failure (retried), ``ce/`` failing on every attempt; it checks the
loads against the uninterrupted run. Mode ``killed`` (run with a ``rank_exit`` fault) dies
while writing ``ck/``.
Rank 0 writes ``results_<mode>.json``; the test asserts on it.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ppoflow.infra.checkpoint.marker import CheckpointWriteFailed
from ppoflow.infra.checkpoint.sharded import load_checkpoint, load_full_state_dict, save_checkpoint
from ppoflow.infra.checkpoint.writer import CheckpointWriter
from tests.support.ckpt.common import (
    Timer,
    batch,
    full_params,
    make_optim,
    max_diff,
    train_step,
    write_results,
)


def build(work: str, shape: tuple[int, ...]):
    """The tiny model under FSDP2 (per layer, then the root) on a mesh of ``shape``, + AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "base"))
    names = ("fsdp",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    return model, opt, sched


def mode_save(work: str, rank: int, world: int, res: dict) -> None:
    c1, c2 = os.path.join(work, "c1"), os.path.join(work, "c2")
    model, opt, sched = build(work, (world,))
    train_step(model, opt, sched, 1, rank, world)
    w1 = full_params(model)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch(9)).logits.detach().clone()
    with Timer(res, "save_s"):
        save_checkpoint(c2, model, opt, sched, extra={"iteration": 1, "step": 1})
    rand_after_save = torch.rand(8)
    s3 = os.environ.get("CKPT_S3_URL")
    if s3:
        with Timer(res, "s3_save_s"):
            save_checkpoint(s3, model, opt, sched, extra={"iteration": 1, "where": "s3"})
    train_step(model, opt, sched, 2, rank, world)
    ref2 = full_params(model)

    with Timer(res, "load_s"):
        res["extra_2to2"] = load_checkpoint(c2, model, opt, sched)
    res["rng_2to2_restored"] = bool(torch.equal(torch.rand(8), rand_after_save))
    res["w_2to2"] = max_diff(full_params(model), w1)
    res["lr_after_load"] = opt.param_groups[0]["lr"]
    train_step(model, opt, sched, 2, rank, world)
    res["step_2to2"] = max_diff(full_params(model), ref2)

    if s3:
        with Timer(res, "s3_load_s"):
            res["extra_s3"] = load_checkpoint(s3, model, opt, sched)
        res["w_s3"] = max_diff(full_params(model), w1)
        train_step(model, opt, sched, 2, rank, world)
        res["step_s3"] = max_diff(full_params(model), ref2)

    load_checkpoint(c1, model, opt, sched)
    res["w_1to2"] = max_diff(full_params(model), load_full_state_dict(c1))
    train_step(model, opt, sched, 2, rank, world)
    step2_from_c1 = full_params(model)
    if rank == 0:
        save_file(step2_from_c1, os.path.join(work, "step2_from_c1.safetensors"))
        save_file(w1, os.path.join(work, "w1.safetensors"))
        save_file(ref2, os.path.join(work, "ref2.safetensors"))
        save_file({"logits": logits}, os.path.join(work, "logits.safetensors"))


def mode_hsdp(work: str, rank: int, world: int, res: dict) -> None:
    model, opt, sched = build(work, (2, world // 2))
    with Timer(res, "load_s"):
        res["extra_2to4"] = load_checkpoint(os.path.join(work, "c2"), model, opt, sched)
    res["w_2to4"] = max_diff(full_params(model), load_file(os.path.join(work, "w1.safetensors")))
    train_step(model, opt, sched, 2, rank, world)
    w = full_params(model)
    res["step_2to4"] = max_diff(w, load_file(os.path.join(work, "ref2.safetensors")))
    with Timer(res, "save_s"):
        save_checkpoint(os.path.join(work, "c4"), model, opt, sched, extra={"iteration": 2})
    if rank == 0:
        save_file(w, os.path.join(work, "w4.safetensors"))


def mode_async(work: str, rank: int, world: int, res: dict) -> None:
    w1 = load_file(os.path.join(work, "w1.safetensors"))
    ref2 = load_file(os.path.join(work, "ref2.safetensors"))
    model, opt, sched = build(work, (world,))
    train_step(model, opt, sched, 1, rank, world)
    writer = CheckpointWriter(backoff_s=0.1)
    out = writer.save(os.path.join(work, "ca"), model, opt, sched, extra={"step": 1}, background=True)
    res["staged_s"] = round(out["staged_s"], 4)
    train_step(model, opt, sched, 2, rank, world)  # FSDP collectives while the write runs
    res["after_step2_while_writing"] = max_diff(full_params(model), ref2)
    res["write_a"] = writer.wait()["write_s"]

    fresh, fopt, fsched = build(work, (world,))
    res["extra_a"] = load_checkpoint(os.path.join(work, "ca"), fresh, fopt, fsched)
    res["w_a"] = max_diff(full_params(fresh), w1)
    train_step(fresh, fopt, fsched, 2, rank, world)
    res["step_a"] = max_diff(full_params(fresh), ref2)

    threaded = CheckpointWriter(threads=2)  # two files per rank, written in parallel
    threaded.save(os.path.join(work, "cb"), model, opt, sched, extra={"k": "b"}, background=True)
    out = threaded.save(os.path.join(work, "cc"), model, opt, sched, extra={"k": "c"}, background=True)
    res["waited_for_b"] = out["waited_s"] >= 0.0
    threaded.close()

    os.environ["PPOFLOW_FAULT"] = "rank_raise:checkpoint_write:1"
    writer.save(os.path.join(work, "cd"), model, opt, sched, extra={"k": "d"}, background=True)
    res["retried_ok"] = writer.wait()["url"].endswith("cd")

    def fails_with(fault: str, name: str, text: str) -> bool:
        """A background save of ``work/name`` under ``fault``: its wait raised, naming ``text``."""
        os.environ["PPOFLOW_FAULT"] = fault
        writer.save(os.path.join(work, name), model, opt, sched, extra={"k": name[1]}, background=True)
        try:
            writer.wait()
        except CheckpointWriteFailed as exc:
            return text in str(exc)
        return False

    res["failed_raised"] = fails_with("rank_raise:checkpoint_write:1:always", "ce", "injected fault")
    # every shard written, then rank 0 cannot publish the marker (a full disk): both ranks raise
    res["publish_failed_raised"] = fails_with(
        "rank_raise:checkpoint_publish:0", "cf", "publishing ppoflow_complete.json"
    )
    os.environ.pop("PPOFLOW_FAULT")
    writer.close()


def mode_killed(work: str, rank: int, world: int, res: dict) -> None:
    model, opt, sched = build(work, (world,))
    train_step(model, opt, sched, 1, rank, world)
    writer = CheckpointWriter()
    writer.save(os.path.join(work, "ck"), model, opt, sched, background=True)
    writer.wait()  # rank 1 exits inside the write; rank 0 waits until torchrun ends it


def main() -> None:
    mode, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict = {"world": world}
    modes = {"save": mode_save, "hsdp": mode_hsdp, "async": mode_async, "killed": mode_killed}
    modes[mode](work, rank, world, res)
    if rank == 0:
        write_results(os.path.join(work, f"results_{mode}.json"), res)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
