"""How often a model calls a tool before any training: the first turn of the multi-turn rollout,
sampled with vLLM from a dataset's prompts, and the share of samples with a well-formed call of a
tool on offer (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` naming one of
``--tools``). RL can only reinforce calls the policy already makes now and then: a share of 0 at the
rollout's temperature means the reward never sees a call.

The prompts are rendered as the rollout renders them (``rollout.multi_turn.tool_format``: the
template's tool format, else the tag in a system message), so the figure is the one the first
iteration of ``ppoflow run`` starts from.

    python benchmarks/tool_call_rate.py --model runs/smollm2/model \\
        --data runs/multiturn/data/test.parquet --prompts 16 --samples 8 --temperature 1.0 0.7
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--data", required=True, help="a parquet file in veRL's format (its prompt column)")
    ap.add_argument("--tools", nargs="+", default=["python"], help="the tools on offer (registered names)")
    ap.add_argument("--tool-format", choices=("auto", "template", "tag"), default="auto")
    ap.add_argument("--prompts", type=int, default=16, help="the first N prompts of the file")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    ap.add_argument("--max-tokens", type=int, default=128, help="the turn's token limit")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--json", default=None, help="also write the result to this file")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from ppoflow.infra.envs.tool_env import row_messages
    from ppoflow.infra.envs.tools import build_tool, parse_tool_calls
    from ppoflow.workers.rollout.chat_turns import ChatFormat

    tok = AutoTokenizer.from_pretrained(args.model)
    fmt = ChatFormat(tok, args.tool_format)
    tools = [build_tool(name) for name in args.tools]
    schemas = [t.schema() for t in tools]
    rows = pq.read_table(args.data, columns=["prompt"]).to_pylist()[: args.prompts]
    if not rows:
        raise SystemExit(f"{args.data} has no rows")
    prompts = [
        {"prompt_token_ids": fmt.prompt_tokens(row_messages({"raw_prompt": r["prompt"]}), schemas)}
        for r in rows
    ]
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=dtype, max_model_len=max(lengths) + args.max_tokens, enforce_eager=True)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s; tool format {fmt.mode}; prompt tokens "
          f"{min(lengths)}-{max(lengths)}", flush=True)  # fmt: skip
    names = {t.name for t in tools}
    result = {"model": args.model, "data": args.data, "tool_format": fmt.mode, "rows": []}
    for temp in args.temperature:
        params = SamplingParams(n=args.samples, temperature=temp, max_tokens=args.max_tokens)
        texts = [o.text for out in llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]
        calls = [parse_tool_calls(t) for t in texts]
        good = sum(bool(c) and all(x.error is None and x.name in names for x in c) for c in calls)
        tagged = sum("<tool_call>" in t for t in texts)
        row = {"temperature": temp, "samples": len(texts), "well_formed": good, "with_tag": tagged}
        result["rows"].append(row)
        print(
            f"temperature {temp:.2f}: {good}/{len(texts)} samples call a tool on offer "
            f"({100 * good / len(texts):.1f}%), {tagged} write <tool_call>",
            flush=True,
        )
        example = next((t for t, c in zip(texts, calls) if c), texts[0])
        print(f"  a sample: {example[:200]!r}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
