"""Actor-update throughput: ``DataParallelPPOActor.update_policy`` on a Qwen2.5-0.5B-shaped policy.

Random weights, a synthetic rollout, FSDP2 on one rank (or more with torchrun: the sequences are
split over the ranks). Sweeps the variants that decide the actor's MFU in one process and prints
one table: tokens/s, MFU and peak memory per variant.

    python benchmarks/actor_update.py                                   # H200: the default sweep
    python benchmarks/actor_update.py --lengths full,uneven             # + the packing gain
    python benchmarks/actor_update.py --batching rows:16,rows:32 --recompute on,off --head checkpoint,fused
    torchrun --nproc-per-node=2 benchmarks/actor_update.py --batching tokens:49152
    python benchmarks/actor_update.py --tiny --device cpu               # a smoke run on a CPU

Every option below takes a comma list; every combination runs (a combination that runs out of
GPU memory prints ``OOM`` and the sweep goes on):
- ``--batching``: ``rows:N`` = padded micro-batches of N sequences (``ppo_micro_batch_size_per_gpu``);
  ``tokens:N`` = packed micro-batches of at most N real tokens (``use_dynamic_bsz`` with
  ``ppo_max_token_len_per_gpu`` N; no compute on padding). Default on cuda: ``rows:32,tokens:49152``
  (today's best padded setting, and one packed micro-batch per mini-batch of 64 x 768).
- ``--optim``: AdamW's ``fused`` kernel, or torch's ``foreach`` / ``for-loop`` ones. Default
  ``foreach,fused`` on cuda (foreach is torch's default there, DTensor shards included).
- ``--compile`` off/on: ``model.use_torch_compile`` (each decoder layer and the LM-head math
  through ``torch.compile``; the first variant with it pays the compilation in its warm-up).
  Default ``off,on`` on cuda.
- ``--recompute`` on/off (activation checkpointing), ``--head`` checkpoint/fused (LM-head
  backward), ``--reshard`` on/off (FSDP ``reshard_after_forward``).
- ``--lengths``: ``full`` = every prompt and response at full length (no padding);
  ``uneven`` = prompt lengths uniform in [1, P] and response lengths uniform in [1, R] per row
  (about half the positions are padding), as rollouts with a stop token look.

Tokens count real tokens only (the padding a padded micro-batch computes is waste).
MFU = model FLOPs / time / (peak x ranks), with peak 791 TFLOP/s (H200 bf16 dense, measured):
- ``MFU``: the usual count, 6·N·tokens (8·N·tokens with activation recomputation);
- ``useful``: only the matmuls the step needs: 6·(N - V·H)·tokens + 6·V·H·response_tokens
  (PolicyLM applies the LM head to response positions only), no recomputation counted.
``logprob`` columns time ``compute_log_prob`` (forward only: 2·N·tokens) with the same batching.
``warm-up s`` is the variant's build, compilation and untimed calls. ``Δlp`` is the largest log-prob difference to the sweep's first variant on the same data (a
sanity check of packed vs padded numerics: bf16 rounding only). ``mb/step`` = micro-batches per
optimizer step.

Defaults: fp32 master weights with bf16 compute (FSDP ``MixedPrecisionPolicy(bf16, fp32)``), as
ppoflow recommends on GPUs; ``--master-dtype bfloat16`` trains pure bf16. Needs torch, transformers,
numpy, pyarrow, fsspec (``ppoflow.infra.data.dataproto``); not pydantic, vLLM or Prefect.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import time

import torch
import torch.distributed as dist
from actor_setup import build_actor, init_distributed, synthetic_rollout  # benchmarks/actor_setup.py

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.actor import DataParallelPPOActor
from ppoflow.workers.modeling import HEAD_IMPLS
from ppoflow.workers.optim import optimizer_kernel

OPTIMS = ("fused", "foreach", "for-loop")
LENGTHS = ("full", "uneven")


def _list(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def _batching(text: str) -> tuple[str, int]:
    kind, _, value = text.partition(":")
    if kind not in ("rows", "tokens") or not value.isdigit():
        raise argparse.ArgumentTypeError(f"--batching entries are rows:N or tokens:N, got {text!r}")
    return kind, int(value)


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
        "--batching",
        default=None,
        help="rows:N (padded) or tokens:N (packed) micro-batches, comma list; "
        "default rows:32,tokens:49152 (tiny: rows:2,tokens:96)",
    )
    p.add_argument(
        "--log-prob-micro-batch", type=int, default=None, help="rows variants; default 16 (tiny: 4)"
    )
    p.add_argument(
        "--optim", default=None, help="fused, foreach, for-loop; default foreach,fused (cpu: for-loop,fused)"
    )
    p.add_argument(
        "--compile", default=None, help="torch.compile layers + head: off, on; default off,on on cuda"
    )
    p.add_argument(
        "--recompute", default="off", help="activation checkpointing of each decoder layer: on, off"
    )
    p.add_argument("--head", default="fused", help="LM-head backward: checkpoint, fused")
    p.add_argument("--reshard", default="on", help="FSDP reshard_after_forward: on, off")
    p.add_argument("--lengths", default="full", help="full, uneven (see above)")
    p.add_argument("--chunk-size", type=int, default=1024, help="tokens per log-prob chunk of the LM head")
    p.add_argument("--master-dtype", default=None, help="parameter dtype; default float32")
    p.add_argument(
        "--param-dtype",
        default=None,
        help="FSDP compute dtype ('none' = the master dtype); default bfloat16 on cuda, none on cpu",
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
    p.add_argument(
        "--profile-dir",
        default=None,
        help="write a torch.profiler op table of one more update per variant here",
    )
    args = p.parse_args(argv)
    tiny = args.tiny
    for name, big, small in (
        ("sequences", 256, 8),
        ("prompt_len", 512, 32),
        ("response_len", 256, 16),
        ("mini_batch", 64, 4),
        ("batching", "rows:32,tokens:49152", "rows:2,tokens:96"),
        ("compile", "off,on" if args.device == "cuda" else "off", None),
        ("log_prob_micro_batch", 16, 4),
        ("optim", "foreach,fused" if args.device == "cuda" else "for-loop,fused", None),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if tiny and small is not None else big)
    try:
        args.batchings = [_batching(x) for x in _list(args.batching)]
    except argparse.ArgumentTypeError as err:
        p.error(str(err))
    on_off = {"on": True, "off": False}
    for name, allowed in (
        ("recompute", on_off),
        ("reshard", on_off),
        ("compile", on_off),
        ("head", HEAD_IMPLS),
    ):
        values = _list(getattr(args, name))
        if any(v not in allowed for v in values):
            p.error(f"--{name} takes {', '.join(allowed)}")
        setattr(args, name + "s", [on_off[v] if allowed is on_off else v for v in values])
    args.optims, args.lengthss = _list(args.optim), _list(args.lengths)
    if any(o not in OPTIMS for o in args.optims) or any(x not in LENGTHS for x in args.lengthss):
        p.error(f"--optim takes {', '.join(OPTIMS)}; --lengths takes {', '.join(LENGTHS)}")
    longest = args.prompt_len + args.response_len
    if any(kind == "tokens" and n < longest for kind, n in args.batchings):
        p.error(f"a tokens:N budget must hold a whole sequence: N >= prompt + response = {longest}")
    args.master_dtype = args.master_dtype or "float32"
    if args.param_dtype is None:
        args.param_dtype = "bfloat16" if args.device == "cuda" else "none"
    return args


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


def run_point(
    args: argparse.Namespace, point: dict, world: int, rank: int, device: torch.device, first_lp: dict
) -> dict:
    """Build the actor for one combination, time compute_log_prob and update_policy, return the row."""
    torch._dynamo.reset()  # each variant compiles afresh: its numbers do not depend on the order
    t_build = time.perf_counter()
    actor, n_params, hf_cfg = build_actor(args, point, world, device)
    full = synthetic_rollout(
        args.sequences, args.prompt_len, args.response_len, hf_cfg.vocab_size, point["lengths"], seed=0
    )
    share = args.sequences // world
    data = full[rank * share : (rank + 1) * share]
    # compute_log_prob: the first call warms up, the second is timed; its output is the "old" policy
    actor.compute_log_prob(data[: min(share, args.log_prob_micro_batch)])
    lp_s, (old, _) = timed(lambda: actor.compute_log_prob(data), device)
    mask = data.batch["response_mask"].bool()
    ref = first_lp.setdefault(point["lengths"], old)
    lp_diff = float((old - ref)[mask].abs().max()) if mask.any() else 0.0
    data.batch["old_log_probs"] = old + 0.01 * torch.randn(
        old.shape, generator=torch.Generator().manual_seed(1)
    )
    if args.kl_loss:
        data.batch["ref_log_prob"] = old.clone()
    for _ in range(args.warmup):
        actor.update_policy(data)
    _sync(device)
    warmup_s = time.perf_counter() - t_build
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        seconds, metrics = timed(lambda: actor.update_policy(data), device)
        times.append(seconds)
    step_s = sum(times) / len(times)
    if args.profile_dir and rank == 0:
        profile_update(
            actor, data, device, os.path.join(args.profile_dir, f"profile_{len(first_lp)}_{_name(point)}.txt")
        )

    tokens = int(full.batch["attention_mask"].sum())
    resp_tokens = int(full.batch["response_mask"].sum())
    head = hf_cfg.vocab_size * hf_cfg.hidden_size
    peak = args.peak_tflops * 1e12 * world
    flops = (8 if point["recompute"] else 6) * n_params * tokens
    useful = 6 * (n_params - head) * tokens + 6 * head * resp_tokens
    return {
        **point,
        "batching": f"{point['batching'][0]}:{point['batching'][1]}",
        "optimizer_kernel": optimizer_kernel(actor.optimizer),
        "params_M": round(n_params / 1e6, 1),
        "tokens": tokens,
        "padding_share": round(1 - tokens / full.batch["attention_mask"].numel(), 3),
        "warmup_s": round(warmup_s, 1),
        "update_s": round(step_s, 4),
        "update_tokens_per_s": round(tokens / step_s, 1),
        "mfu": round(flops / step_s / peak, 4),
        "mfu_formula": "8N" if point["recompute"] else "6N",
        "mfu_useful": round(useful / step_s / peak, 4),
        "logprob_s": round(lp_s, 4),
        "logprob_tokens_per_s": round(tokens / lp_s, 1),
        "logprob_mfu": round(2 * n_params * tokens / lp_s / peak, 4),
        "logprob_max_diff": round(lp_diff, 5),
        "optimizer_steps": metrics["actor/optimizer_steps"],
        "micro_batches_per_step": metrics["actor/micro_batches"],
        "grad_norm": round(metrics["actor/grad_norm"], 4),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
    }


def _name(point: dict) -> str:
    kind, size = point["batching"]
    return "_".join(
        [
            point["lengths"],
            f"{kind}{size}",
            point["optim"],
            "compiled" if point["compile"] else "eager",
            "rc" if point["recompute"] else "norc",
            point["head"],
        ]
        + ([] if point["reshard"] else ["noreshard"])
    )


def profile_update(actor: DataParallelPPOActor, data: DataProto, device: torch.device, path: str) -> None:
    """One more ``update_policy`` under torch.profiler; its op table (by device time) goes to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        actor.update_policy(data)
        _sync(device)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=60))


HEADER = (
    f"{'lengths':>7} {'batching':>13} {'optim':>8} {'compile':>7} {'recomp':>6} {'head':>10} {'reshard':>7} | "
    f"{'update s':>8} {'tok/s':>9} {'MFU':>6} {'useful':>6} {'mb/step':>7} | "
    f"{'logprob tok/s':>13} {'MFU':>6} {'Δlp':>8} | {'peak GiB':>8} {'warm-up s':>9}"
)


def _row(r: dict) -> str:
    """One table line of a result (or of an OOM)."""
    batching = r["batching"] if isinstance(r["batching"], str) else "{}:{}".format(*r["batching"])
    head = (
        f"{r['lengths']:>7} {batching:>13} {r.get('optimizer_kernel', r['optim']):>8} "
        f"{'on' if r['compile'] else 'off':>7} {'on' if r['recompute'] else 'off':>6} {r['head']:>10} {'on' if r['reshard'] else 'off':>7} | "
    )
    if "error" in r:
        return f"{head}{r['error']}"
    return (
        f"{head}{r['update_s']:>8.3f} {r['update_tokens_per_s']:>9.0f} {r['mfu']:>6.3f} "
        f"{r['mfu_useful']:>6.3f} {r['micro_batches_per_step']:>7.1f} | {r['logprob_tokens_per_s']:>13.0f} "
        f"{r['logprob_mfu']:>6.3f} {r['logprob_max_diff']:>8.1e} | {r['peak_mem_GiB']!s:>8} {r['warmup_s']:>9.1f}"
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
        "torch": torch.__version__,
    }
    if rank == 0:
        print(
            f"actor update: {setup['model']}, {world} rank(s) on {args.device}, master {args.master_dtype}, "
            f"compute {args.param_dtype}, {args.sequences} x ({args.prompt_len} + {args.response_len}) "
            f"positions, mini-batch {args.mini_batch}, head chunk {args.chunk_size}, torch {torch.__version__}"
        )
        print(HEADER, flush=True)
    results, first_lp = [], {}
    axes = (
        args.lengthss,
        args.batchings,
        args.optims,
        args.compiles,
        args.recomputes,
        args.heads,
        args.reshards,
    )
    for lengths, batching, optim, compiled, recompute, head, reshard in itertools.product(*axes):
        point = dict(
            lengths=lengths,
            batching=batching,
            optim=optim,
            compile=compiled,
            recompute=recompute,
            head=head,
            reshard=reshard,
        )
        try:
            result = {**setup, **run_point(args, point, world, rank, device, first_lp)}
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
