"""GPU check: after iterations of the real ``ppo`` flow, did each rollout sample from exactly the
weights it should have?

The rollout of iteration n must use the actor of iteration n-1. One flow run does iterations 1 and
2, a second flow run iteration 3, so each way weights reach the engine is covered: iteration 1
pushes the base weights from the FSDP module as built, iteration 2 the live module after the first
update (the path of every later iteration of a run), iteration 3 reads the DCP checkpoint of
iteration 2 from storage (the first rollout of a resumed run or of a rebuilt group). For each
rollout the check compares, over response tokens, the engine's own log-probs of the sampled tokens
(``rollout_log_probs``) with

- ``old_log_probs``: the FSDP actor's forward of the same tokens, in the same task;
- a transformers forward (float32) of ``ppoflow export-hf --iteration n-1``: the committed weights;
- from iteration 2 on, also the weights one iteration older (``--iteration n-2``): the *stale
  control*. It must be far off, or the check could not have told right weights from stale ones
  (exit 2). ``--no-resume`` skips the second flow run (iterations 1 and 2 only).

    python benchmarks/gpu_check.py --device cuda --ranks 1              # one GPU, vLLM TP 1
    python benchmarks/gpu_check.py --device cuda --ranks 2 --tp 2       # two GPUs, one TP=2 engine
    python benchmarks/gpu_check.py --device cpu                         # CPU, fp32, a small model
    python benchmarks/gpu_check.py --device cuda --ranks 1 --lora-rank 16  # a LoRA policy (merged into
                                      # vLLM's weights; ``--lora-sync adapter``: vLLM serves the adapter;
                                      # the references are ``export-hf --merge``)

Tolerances (``--tol-mean``, ``--tol-max``; over response tokens):

- bf16 on GPU (default 0.03 mean, 0.25 max): vLLM and the FSDP actor both compute in bfloat16 (an
  8-bit mantissa: every rounding is up to 0.4% of the value) with different kernels (vLLM's
  FlashAttention, fused RMSNorm + residual and its own matmul tilings against SDPA and separate ops
  in the actor), so each is off the float32 forward by bf16 noise, independently. On this random
  Qwen2.5-0.5B shape a transformers bf16 forward is 0.012 mean / 0.045 max (512 tokens) off its own
  float32 forward (measured on CPU); two independent bf16 paths differ by about sqrt(2) of that,
  and the max over tens of thousands of tokens reaches further into the tail. One iteration of
  staleness at the check's learning rate (1e-3: Adam moves every weight by ~1e-3 per step, 4 steps
  an iteration) moves the log-probs by ~0.3 mean, ten times the mean tolerance;
- float32 on CPU (1e-5 mean, 1e-4 max): both engines compute in float32; what remains is summation
  order (vLLM's CPU backend against transformers: ~1e-6, FIELD-NOTES: within 1.1e-5).

The flow's own sampler/trainer metrics of each iteration (``mismatch/*``: token_mult_prob_error,
the k1/k3 KL, the largest |d log p|, ...; ``benchmarks/mismatch_report.py``) are printed after the
comparisons: the same question as the first row, measured every iteration of every run.

Exit status: 0 all within tolerance, 1 some comparison over it, 2 the stale control was not
separated (raise ``--lr``). With ``PPOFLOW_FAULT`` set (e.g. ``rank_exit:update_actor:1``) the flow
runs through the drill and the check prints the failure path it saw (the dead rank, the rebuilt
group) before the figures. The result is also one JSON line (``gpu_check: {...}``) and, with
``OUT`` set, ``$OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from iteration import build_model, build_prompts, experiment_config, kv_budget

TOLERANCE = {"bf16": (0.03, 0.25), "fp32": (1e-5, 1e-4)}
WHY = {
    "bf16": "vLLM and the FSDP actor each round to bfloat16 (8-bit mantissa) in different kernels; a "
    "transformers bf16 forward of this shape is 0.012 mean / 0.045 max off float32",
    "fp32": "float32 everywhere: only the summation order differs (~1e-6)",
}
STALE_FACTOR = 2.0  # the stale control's mean must exceed the right weights' by this factor
SOURCES = {
    1: "the FSDP module as built (base weights), first flow run",
    2: "the live FSDP module after update 1, same flow run",
    3: "DCP checkpoint 2 read from storage, second flow run",
}
FAILURE = re.compile(r"died during|raised in|injected fault|AwaitingRetry|Retrying")
DRILL = re.compile(r"died during|raised in|worker group \(|injected fault|AwaitingRetry|Retrying")


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if cuda else "cpu")
    p.add_argument("--ranks", type=int, default=None, help="default: 1 on cuda, 2 on cpu")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor parallelism")
    p.add_argument("--preset", default=None, help="model shape (benchmarks/iteration.py); default by device")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--n", type=int, default=1, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--response-len", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument(
        "--lr", type=float, default=1e-3, help="actor learning rate (large: see the stale control)"
    )
    p.add_argument("--loader", choices=("hf", "dtensor"), default="hf", help="FSDP -> vLLM push with TP > 1")
    p.add_argument(
        "--eager", action=argparse.BooleanOptionalAction, default=None, help="default: graphs on GPU"
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=None, help="default: the config's")
    p.add_argument("--kv-cache-gib", type=kv_budget, default=None, help="GiB, auto (default) or profile")
    p.add_argument(
        "--tol-mean", type=float, default=None, help="default: by compute dtype (module docstring)"
    )
    p.add_argument("--tol-max", type=float, default=None)
    p.add_argument("--storage", default=None, help="where the experiment goes (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument(
        "--resume", action=argparse.BooleanOptionalAction, default=True, help="iteration 3 in a new run"
    )
    p.add_argument("--dynamic-bsz", action="store_true", help="packed token-budget micro-batches")
    p.add_argument("--compile", action="store_true", help="model.use_torch_compile")
    p.add_argument("--lora-rank", type=int, default=0, help="a LoRA policy (and critic) of this rank")
    p.add_argument("--lora-alpha", type=float, default=None, help="lora.alpha (default: 2 x rank)")
    p.add_argument("--lora-sync", choices=("adapter", "merged"), default="merged", help="actor.lora.sync")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = dict(
        ranks=1 if gpu else 2,
        preset="qwen2.5-0.5b" if gpu else "small",
        prompts=64 if gpu else 16,
        prompt_len=256 if gpu else 24,
        response_len=128 if gpu else 12,
        micro_batch=16 if gpu else 4,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = "bf16" if gpu else "fp32"
    tol_mean, tol_max = TOLERANCE[args.dtype]
    args.tol_mean = tol_mean if args.tol_mean is None else args.tol_mean
    args.tol_max = tol_max if args.tol_max is None else args.tol_max
    # what experiment_config (benchmarks/iteration.py) reads
    args.engine, args.mini_batch, args.log_prob_micro_batch, args.recompute = (
        "vllm",
        None,
        args.micro_batch,
        False,
    )
    args.max_num_seqs = args.max_num_batched_tokens = args.max_token_len = None
    args.snapshot_every = None  # the config's default: the resume drill goes through replay
    args.deterministic = False  # the default kernels: the check compares within tolerances
    args.rollout_log_probs = True  # the engine's own log-probs are what the check compares
    args.overlap, args.sync_checkpoints = (
        "none",
        False,
    )  # on-policy: the rollout must use the commit's weights
    return args


class DrillLog(logging.Handler):
    """Keeps the flow's log lines about failures, retries and (re)started worker groups."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        first = record.getMessage().splitlines()[0] if record.getMessage() else ""
        if DRILL.search(first) and first not in self.lines:
            self.lines.append(first)


def run_flow(args, work: str) -> tuple[str, DrillLog]:
    """Model, prompts, config; iterations 1-2 in one flow run, 3 in another (unless ``--no-resume``).
    Returns the experiment URL and the drill log."""
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.config import parse_config
    from ppoflow.infra.runtime.signals import install_stop_handlers

    model_dir, data_url = os.path.join(work, "model"), os.path.join(work, "prompts.parquet")
    n_params = build_model(model_dir, args.preset, args.prompt_len + args.response_len + 8)
    build_prompts(data_url, args.prompts * 4, args.prompt_len)
    data = experiment_config(args, model_dir, data_url, os.path.join(work, "runs"))
    data["actor"]["optim"]["lr"] = args.lr
    data["checkpoint"]["keep_last"] = None  # every iteration's weights are exported and compared
    data["rollout"]["temperature"] = 1.0
    cfg = parse_config(data, source="gpu_check config")
    print(f"model: {args.preset} ({n_params / 1e6:.1f}M params, random weights)", flush=True)
    drill = DrillLog()
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addHandler(drill)
    install_stop_handlers()
    for iterations in (2, 1) if args.resume else (2,):
        t0 = time.perf_counter()
        ppo(cfg, iterations=iterations)
        print(f"flow run: {iterations} iteration(s) in {time.perf_counter() - t0:.1f} s", flush=True)
    return cfg.storage.experiment_url, drill


def export(exp: str, iteration: int, out: str, merge: bool = False) -> str:
    """``ppoflow export-hf EXP OUT --iteration k``, the user's command, in a subprocess (``merge``:
    a LoRA run's adapters merged into the base, a plain HF directory)."""
    cmd = [sys.executable, "-m", "ppoflow.cli", "export-hf", exp, out, "--iteration", str(iteration)]
    cmd += ["--merge"] if merge else []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def reference_log_probs(model_dir: str, rollout, device: str, rows: int = 8):
    """(B, R) float32 log-probs of the rollout's responses under ``model_dir``: a transformers
    forward in float32 (no TF32), ``log_softmax(logits / T)`` at the response positions."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    batch, p = rollout.batch, rollout.batch["prompts"].shape[1]
    temperature = float(rollout.meta_info.get("temperature", 1.0))
    out = []
    with torch.no_grad():
        for i in range(0, len(rollout), rows):
            sl = slice(i, i + rows)
            logits = model(
                input_ids=batch["input_ids"][sl].to(device),
                attention_mask=batch["attention_mask"][sl].to(device),
                position_ids=batch["position_ids"][sl].to(device),
            ).logits[:, p - 1 : -1]
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            out.append(logp.gather(-1, batch["responses"][sl].to(device).unsqueeze(-1)).squeeze(-1).cpu())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return torch.cat(out)


def compare(a, b, mask) -> dict:
    d = (a - b).abs()[mask.bool()]
    return {"tokens": int(d.numel()), "mean": float(d.mean()), "max": float(d.max())}


def check(args, exp: str, work: str) -> dict:
    """The comparisons of every iteration and the verdict."""
    from ppoflow.infra.data.dataproto import DataProto

    device = "cuda" if args.device == "cuda" else "cpu"
    last = 3 if args.resume else 2
    merge = bool(args.lora_rank)
    hf = {k: export(exp, k, os.path.join(work, f"hf-{k}"), merge) for k in range(last)}
    rows, separated = [], True
    for n in range(1, last + 1):
        rollout = DataProto.load(os.path.join(exp, "iterations", f"{n:06d}", "rollout.arrow"))
        mask, got, old = (rollout.batch[k] for k in ("response_mask", "rollout_log_probs", "old_log_probs"))
        right = reference_log_probs(hf[n - 1], rollout, device)
        pairs = [
            ("rollout vs old_log_probs (FSDP actor)", got, old),
            (f"rollout vs transformers(export-hf {n - 1})", got, right),
            (f"old vs transformers(export-hf {n - 1})", old, right),
        ]
        for pair, a, b in pairs:
            r = dict(iteration=n, source=SOURCES[n], pair=pair, **compare(a, b, mask))
            r["within"] = r["mean"] <= args.tol_mean and r["max"] <= args.tol_max
            rows.append(r)
        if n >= 2:  # the weights one iteration older: the check must be able to tell them apart
            stale = reference_log_probs(hf[n - 2], rollout, device)
            r = dict(
                iteration=n, source=SOURCES[n], pair=f"rollout vs transformers(export-hf {n - 2}): stale"
            )
            r.update(compare(got, stale, mask), within=None)
            r["separated"] = r["mean"] > max(args.tol_mean, STALE_FACTOR * rows[-2]["mean"])
            separated &= r["separated"]
            rows.append(r)
    ok = all(r["within"] for r in rows if r["within"] is not None)
    verdict = "PASS" if ok and separated else ("FAIL" if not ok else "INCONCLUSIVE")
    metrics = [
        json.load(open(os.path.join(exp, "iterations", f"{n:06d}", "metrics.json")))
        for n in range(1, last + 1)
    ]
    return {"verdict": verdict, "separated": separated, "rows": rows, "metrics": metrics}


def report(args, result: dict, drill: DrillLog) -> str:
    graphs = args.device == "cuda" if args.eager is None else not args.eager
    lines = [
        f"gpu_check: {args.preset}, {args.ranks} rank(s) on {args.device}, vLLM TP {args.tp} "
        f"({'CUDA graphs' if graphs else 'eager'}, push loader {args.loader}, sleep level "
        f"{args.sleep_level or 'default'}), {args.dtype} compute; "
        f"{args.prompts} prompts x {args.n}, prompt {args.prompt_len}, response {args.response_len}; "
        f"actor lr {args.lr:g}",
        f"tolerance ({args.dtype}, over response tokens): mean |d| <= {args.tol_mean:g}, max |d| <= "
        f"{args.tol_max:g}: {WHY[args.dtype]}",
    ]
    fault = os.environ.get("PPOFLOW_FAULT")
    if fault or any(FAILURE.search(line) for line in drill.lines):
        lines += ["", f"failure path seen by the flow (PPOFLOW_FAULT={fault or ''}):"]
        lines += [f"  {line[:200]}" for line in drill.lines]
    lines += ["", f"{'iter':<5}{'comparison':<50}{'tokens':>8}{'mean |d|':>11}{'max |d|':>11}  within"]
    shown = None
    for r in result["rows"]:
        if r["iteration"] != shown:
            shown = r["iteration"]
            lines.append(f"{shown:<5}engine weights pushed from: {r['source']}")
        within = {True: "yes", False: "NO", None: "far off" if r.get("separated") else "NOT far off"}[
            r["within"]
        ]
        lines.append(f"{'':<5}{r['pair']:<50}{r['tokens']:>8}{r['mean']:>11.2e}{r['max']:>11.2e}  {within}")
    from mismatch_report import mismatch_lines

    lines += ["", *mismatch_lines(result["metrics"])]  # what the flow itself measured, every iteration
    lines += [
        "",
        f"stale controls {'separated' if result['separated'] else 'NOT separated'} (each mean must exceed "
        f"max(tol_mean, {STALE_FACTOR:g} x the right weights' mean))",
        f"verdict: {result['verdict']}",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.storage or tempfile.mkdtemp(prefix="ppoflow-gpucheck-")
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", os.path.join(work, "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no telemetry (offline)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # a fresh database
    try:
        exp, drill = run_flow(args, work)
        result = check(args, exp, work)
        print(report(args, result, drill))
        summary = {
            "args": vars(args),
            **{k: v for k, v in result.items() if k != "metrics"},
            "drill": drill.lines,
        }
        summary["mismatch"] = [
            {k: v for k, v in m.items() if k.startswith(("mismatch/", "iteration"))}
            for m in result["metrics"]
        ]
        print("gpu_check: " + json.dumps(summary))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        if not args.storage and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"PASS": 0, "FAIL": 1}.get(result["verdict"], 2)


if __name__ == "__main__":
    sys.exit(main())
