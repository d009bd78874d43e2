"""Time DataProto.save / DataProto.load of a rollout-sized batch and print a table.

    .venv/bin/python benchmarks/dataproto_io.py [--rows 1024] [--prompt 512] [--response 512]
        [--repeats 5] [--dir /tmp] [--url memory://bench/rollout.arrow]

The batch has the columns of a PPO rollout: input_ids/attention_mask/position_ids (B, P+R) int64,
prompts/responses/response_mask (B, P|R) int64, old_log_probs/ref_log_prob/values/advantages/
returns (B, R) float32, a string column and meta_info. GB/s = bytes / seconds (1 GB = 1e9 bytes);
"combined" is the round trip: bytes / (save s + load s). Each row is the best of ``--repeats``
runs after one warm-up run, each run writing a new file (the data stays in the page cache: this
measures the codec and the kernel's page cache, not the disk).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto


def rollout_batch(rows: int, prompt: int, response: int) -> DataProto:
    """A DataProto shaped like one PPO rollout."""
    g = torch.Generator().manual_seed(0)
    total = prompt + response
    tensors = {
        "input_ids": torch.randint(0, 150_000, (rows, total), generator=g),
        "attention_mask": torch.ones(rows, total, dtype=torch.int64),
        "position_ids": torch.arange(total).repeat(rows, 1),
        "prompts": torch.randint(0, 150_000, (rows, prompt), generator=g),
        "responses": torch.randint(0, 150_000, (rows, response), generator=g),
        "response_mask": torch.ones(rows, response, dtype=torch.int64),
    }
    for key in ("old_log_probs", "ref_log_prob", "values", "advantages", "returns"):
        tensors[key] = torch.randn(rows, response, generator=g)
    non_tensors = {"uid": np.array([f"prompt-{i // 8:06d}" for i in range(rows)], dtype=object)}
    return DataProto.from_dict(tensors, non_tensors, meta_info={"iteration": 12, "temperature": 1.0})


def payload_bytes(proto: DataProto) -> int:
    """Bytes of tensor data plus string characters."""
    n = sum(t.numel() * t.element_size() for t in proto.batch.values())
    return n + sum(len(s) for a in proto.non_tensor_batch.values() for s in a)


def time_url(proto: DataProto, url: str, repeats: int) -> tuple[float, float]:
    """Best save and load seconds over ``repeats`` runs, each to a new file name.

    New names as in a real run (every iteration writes new URLs): on ext4, replacing an
    existing file forces writeback of the new one (auto_da_alloc), which a retry pays but a
    normal iteration does not. Files are removed outside the timed region.
    """
    stem, ext = url.rsplit(".", 1)
    proto.save(f"{stem}-warmup.{ext}")  # warm-up
    DataProto.load(f"{stem}-warmup.{ext}")
    storage.rm(f"{stem}-warmup.{ext}")
    saves, loads = [], []
    for i in range(repeats):
        target = f"{stem}-{i}.{ext}"
        t0 = time.perf_counter()
        proto.save(target)
        t1 = time.perf_counter()
        back = DataProto.load(target)
        t2 = time.perf_counter()
        saves.append(t1 - t0)
        loads.append(t2 - t1)
        storage.rm(target)
    assert torch.equal(back.batch["input_ids"], proto.batch["input_ids"])
    return min(saves), min(loads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="directory for the local file (default: a temp dir)")
    parser.add_argument(
        "--url", action="append", default=[], help="extra URLs to time (memory://..., s3://...)"
    )
    args = parser.parse_args(argv)

    proto = rollout_batch(args.rows, args.prompt, args.response)
    nbytes = payload_bytes(proto)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        targets = [
            ("local file", os.path.join(tmp, "rollout.arrow")),
            ("file:// URL", "file://" + os.path.join(tmp, "r2.arrow")),
        ]
        targets += [(url.split("://")[0] + "://", url) for url in args.url]
        print(
            f"DataProto {args.rows} x {args.prompt}+{args.response} tokens, {len(proto.batch)} tensors + 1 string column"
        )
        print(
            f"{'target':<12} {'bytes':>12} {'save s':>8} {'load s':>8} {'save GB/s':>10} {'load GB/s':>10} {'comb. GB/s':>10}"
        )
        for name, url in targets:
            save_s, load_s = time_url(proto, url, args.repeats)
            print(
                f"{name:<12} {nbytes:>12,} {save_s:>8.4f} {load_s:>8.4f} {nbytes / save_s / 1e9:>10.2f} "
                f"{nbytes / load_s / 1e9:>10.2f} {nbytes / (save_s + load_s) / 1e9:>10.2f}"
            )


if __name__ == "__main__":
    main()
