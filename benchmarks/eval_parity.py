"""Does evaluation agree with itself? The held-out score of one iteration, got four ways, on the
same files:

    in training        the ``val/score`` the run committed (``iterations/<n>/eval/val/``)
    eval --iteration   ``ppoflow eval EXPERIMENT --iteration n --files <a copy of the files>`` (a
                       fresh worker group loading checkpoint n; the copy makes it a new evaluation,
                       not training's result found again)
    eval --model       ``ppoflow export-hf EXPERIMENT OUT --iteration n``, then ``ppoflow eval
                       EXPERIMENT --model OUT`` (vLLM loads the exported directory)
    plain vLLM         no ppoflow code: ``vllm.LLM(OUT)`` in a process of its own, the prompts
                       through the tokenizer's chat template as text, greedy, the same number of
                       new tokens, the config's reward function on ``output.text``; once with the
                       dtype ppoflow's engine ran in (``rollout.dtype``, else ``model.dtype``) and
                       once with vLLM's default ``dtype="auto"`` (a float32 checkpoint runs in
                       bfloat16 there)

for iteration 0 (the base model; ``eval --model`` and plain vLLM on ``model.path``) and the run's
last iteration, with per-prompt agreement against training's responses. The run is ``ppoflow run
CONFIG --iterations N`` (evaluating before training and at the end only, the first ``--prompts``
held-out rows); an experiment already at N is reused.

    python benchmarks/eval_parity.py examples/smollm2/cpu.yaml --iterations 2 --prompts 64 \\
        --set data.train_batch_size=4 rollout.n=2 actor.ppo_mini_batch_size=4 critic.enable=false \\
        algorithm.adv_estimator=grpo evaluation.response_length=64 --log docs/bench/eval_parity_cpu.log
    python benchmarks/eval_parity.py examples/smollm2/gpu.yaml --iterations 10 --prompts 256 \\
        --log docs/bench/eval_parity_h200.log                          # one CUDA GPU

Run from the repository root (the example's ``prepare.py`` first). The plain-vLLM processes end
with ``os._exit`` (vLLM's engine can keep a finished script alive).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "ppoflow.cli"]


def _reward(spec: str):
    """The function of ``reward.custom_function`` ("path/to/file.py:name" or "module:name")."""
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        loaded = importlib.util.spec_from_file_location("eval_parity_reward", where)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def plain_vllm(args: argparse.Namespace) -> None:
    """``--plain MODEL``: greedy answers of a plain ``vllm.LLM``, scored; JSON to ``--out``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = [r for f in args.files for r in pq.read_table(f).to_pylist()][: args.prompts]
    tok = AutoTokenizer.from_pretrained(args.plain)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    t0 = time.perf_counter()
    # CPU: eager (compiling the model takes minutes there and gives the same tokens); GPU: vLLM's defaults
    llm = LLM(model=args.plain, dtype=args.dtype, seed=0, enforce_eager=cpu, max_model_len=args.max_model_len)
    dtype = str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")
    outs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=args.tokens), use_tqdm=False)
    score = _reward(args.reward)
    responses = [o.outputs[0].text for o in outs]
    scores = [
        float(score(r["data_source"], t, r["reward_model"]["ground_truth"], r.get("extra_info")))
        for r, t in zip(rows, responses)
    ]
    with open(args.out, "w") as f:
        s = time.perf_counter() - t0
        json.dump(
            {"dtype": dtype, "tokens": args.tokens, "responses": responses, "scores": scores, "s": s}, f
        )
    sys.stdout.flush()
    os._exit(0)


def _run(cmd: list[str], log) -> str:
    log(f"$ {' '.join(cmd)}")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{text[-4000:]}")
    log(f"  ({time.perf_counter() - t0:.0f} s)")
    return out.stdout


def _generations(out_dir: str) -> dict[str, list]:
    import pyarrow as pa
    import pyarrow.ipc

    with pa.OSFile(os.path.join(out_dir, "generations.arrow")) as f:
        return pyarrow.ipc.open_file(f).read_all().to_pydict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="evaluation.max_prompts")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--root", default="runs/eval-parity")
    ap.add_argument("--experiment", default="parity")
    ap.add_argument("--log", default=None)
    # the plain-vLLM child process
    ap.add_argument("--plain", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--files", nargs="*", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reward", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain:
        return plain_vllm(args)
    if not args.config:
        ap.error("give the experiment config")
    lines: list[str] = []

    def log(line: str) -> None:  # paths as seen from the repository root, the interpreter as "python"
        line = line.replace(sys.executable, "python").replace(os.getcwd() + os.sep, "")
        print(line, flush=True)
        lines.append(line)

    import yaml

    from ppoflow.infra.config import load_config
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

    root = os.path.abspath(args.root)
    over = [
        f"storage.root={root}",
        f"storage.experiment={args.experiment}",
        f"evaluation.max_prompts={args.prompts}",
        "evaluation.every=0",
        "evaluation.before_training=true",
        "evaluation.at_end=true",
        *args.set,
    ]
    cfg = load_config(args.config, {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in over)})
    paths = ExperimentPaths.of(cfg)
    n = args.iterations
    manifest = read_manifest(paths)
    log(f"config {args.config} + {' '.join(over)}")
    if manifest is None or manifest.iteration < n:
        sets = [a for o in over for a in ("--set", o)]
        _run(
            [
                *CLI,
                "run",
                args.config,
                "--iterations",
                str(n - (manifest.iteration if manifest else 0)),
                *sets,
            ],
            log,
        )
    exp, val = paths.root, list(cfg.data.val_files)
    engine_dtype = cfg.engine_dtype
    tokens = cfg.evaluation.response_length or cfg.rollout.response_length
    scratch = os.path.join(root, "parity")
    os.makedirs(scratch, exist_ok=True)
    copies = []
    for i, f in enumerate(val):
        copies.append(os.path.join(scratch, f"copy{i}-{os.path.basename(f)}"))
        shutil.copyfile(f, copies[-1])
    export = os.path.join(scratch, f"export-{n}")
    if not os.path.isdir(export):
        _run([*CLI, "export-hf", exp, export, "--iteration", str(n)], log)

    rows: list[tuple[str, int, str, float, list[str]]] = []  # (how, iteration, dtype, score, responses)

    def add(row: tuple[str, int, str, float, list[str]]) -> None:
        # the log holds the table so far after every row: a run cut short (a time limit, a lost
        # machine) still leaves what it measured; the trained iteration's rows come first
        rows.append(row)
        if args.log:
            _write_log(args.log, [*lines, *_table(rows)])

    for it in (n, 0):
        train = _generations(paths.file(it, "eval/val"))
        add(("in training", it, engine_dtype, _mean(train["score"]), train["response"]))
        if it:
            _run([*CLI, "eval", exp, "--iteration", str(it), "--files", *copies], log)
            got = _latest_eval(paths.file(it, "eval"), exclude="val")
            add(("ppoflow eval --iteration", it, engine_dtype, _mean(got["score"]), got["response"]))
        model = cfg.model.path if it == 0 else export
        _run([*CLI, "eval", exp, "--model", model], log)
        got = _generations(os.path.join(exp, "evaluations", _slug(model), "val"))
        label = "ppoflow eval --model " + ("model.path" if it == 0 else f"<export-hf {it}>")
        add((label, it, engine_dtype, _mean(got["score"]), got["response"]))
        for dtype in (engine_dtype, "auto"):
            out = os.path.join(scratch, f"plain-{it}-{dtype}.json")
            cmd = [sys.executable, __file__, "--plain", model, "--dtype", dtype, "--files", *val]
            cmd += [
                "--prompts",
                str(args.prompts),
                "--tokens",
                str(tokens),
                "--reward",
                cfg.reward.custom_function,
            ]
            cmd += ["--max-model-len", str(cfg.rollout.prompt_length + tokens)]
            res = _reused(out, tokens)
            if res is not None:  # made by an earlier run of this script on the same experiment
                log(
                    f"(plain vLLM, iteration {it}, dtype={dtype}: {res['s']:.0f} s in an earlier run, reused {out})"
                )
            else:
                _run([*cmd, "--out", out], log)
                with open(out) as f:
                    res = json.load(f)
            add((f"plain vLLM dtype={dtype}", it, res["dtype"], _mean(res["scores"]), res["responses"]))
    for line in _table(sorted(rows, key=lambda r: r[1])):
        log(line)
    if args.log:
        _write_log(args.log, lines)


def _write_log(path: str, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join([f"$ python {' '.join(sys.argv)}", *lines]) + "\n")


def _reused(out: str, tokens: int) -> dict | None:
    """The plain-vLLM result at ``out`` when an earlier run made it with ``tokens`` new tokens."""
    if not os.path.exists(out):
        return None
    with open(out) as f:
        res = json.load(f)
    return res if res.get("tokens", tokens) == tokens else None


def _mean(xs: list) -> float:
    return sum(float(x) for x in xs) / len(xs)


def _slug(model: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(model.rstrip("/"))) or "model"


def _latest_eval(eval_dir: str, exclude: str) -> dict[str, list]:
    dirs = [os.path.join(eval_dir, d) for d in os.listdir(eval_dir) if d != exclude]
    return _generations(max(dirs, key=os.path.getmtime))


def _table(rows) -> list[str]:
    out = ["", f"{'evaluation':<34} {'iter':>4} {'dtype':<9} {'val/score':>9}  responses as in training"]
    reference = {it: resp for how, it, _, _, resp in rows if how == "in training"}
    for how, it, dtype, score, resp in rows:
        same = sum(a == b for a, b in zip(resp, reference[it]))
        out.append(f"{how:<34} {it:>4} {dtype:<9} {score:>9.4f}  {same}/{len(resp)}")
    return out


if __name__ == "__main__":
    main()
