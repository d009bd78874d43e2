"""Data of the multi-turn example: multiplication problems the policy may solve with the sandboxed
``python`` tool, in veRL's format, under ``--root`` (default ``runs/multiturn``). The model is the
SmolLM2 example's (``python examples/smollm2/prepare.py`` first).

Each prompt opens with one worked exchange (a question, the call, the tool's output, the answer)
before its own question: without it SmolLM2-135M-Instruct wrote no well-formed call in 256
samples, with it 1.2% of its samples call the tool at temperature 1.0 (docs/multiturn.md).
``--shots 0`` leaves it out.

    python examples/multiturn/prepare.py [--root runs/multiturn] [--train 2048] [--test 256] [--shots 1]
"""

from __future__ import annotations

import argparse
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic/mul3"


def _call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "python", "arguments": {{"code": "{a} * {b}"}}}}</tool_call>'


def _question(a: int, b: int) -> str:
    return (
        f"What is {a} * {b}? Compute it with the python tool first, by replying exactly "
        f"{_call(a, b)} then answer with the number only."
    )


# the worked exchange: the tool's output is a `tool` message, rendered as the rollout renders the
# environment's (the chat template's tool format, or a <tool_response> block)
EXAMPLE = [
    {"role": "user", "content": _question(512, 34)},
    {"role": "assistant", "content": _call(512, 34)},
    {"role": "tool", "name": "python", "content": "17408"},
    {"role": "assistant", "content": "17408"},
]


def rows(pairs: list[tuple[int, int]], split: str, shots: int = 1) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [*(EXAMPLE if shots else []), {"role": "user", "content": _question(a, b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/multiturn")
    ap.add_argument("--train", type=int, default=2048)
    ap.add_argument("--test", type=int, default=256)
    ap.add_argument(
        "--shots", type=int, choices=(0, 1), default=1, help="1: a worked exchange opens each prompt"
    )
    args = ap.parse_args()
    rng = random.Random(0)
    pairs = list({(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(4 * (args.train + args.test))})
    pairs = [p for p in pairs if p != (512, 34)]  # the worked example's
    rng.shuffle(pairs)
    os.makedirs(os.path.join(args.root, "data"), exist_ok=True)
    for split, chosen in (("test", pairs[: args.test]), ("train", pairs[args.test : args.test + args.train])):
        path = os.path.join(args.root, "data", f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows(chosen, split, args.shots)), path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"{split}: {len(chosen)} problems -> {path}")


if __name__ == "__main__":
    main()
