"""Helpers shared by tests/infra/checkpoint/test_checkpoints.py (in-process) and the torchrun scripts here.

Every run (1 rank, 2 ranks, a 2x2 HSDP mesh) trains the same tiny model on the same global
batches: batch ``k`` is 4 sequences of 16 tokens drawn from a generator seeded with ``1000 + k``;
rank r of W takes rows ``[r*4/W, (r+1)*4/W)``, so the averaged gradient is the same on any layout.
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.distributed.tensor import DTensor

BATCH, SEQ = 4, 16


def batch(k: int) -> torch.Tensor:
    """Global batch ``k``: (4, 16) token ids of the char tokenizer's byte range."""
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randint(5, 261, (BATCH, SEQ), generator=gen)


def make_optim(model: torch.nn.Module):
    """AdamW + a 3-step linear warmup (so the LR changes between steps and the scheduler matters)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def train_step(model, opt, sched, k: int, rank: int = 0, world: int = 1) -> None:
    """One optimizer step on this rank's rows of batch ``k``."""
    ids = batch(k)
    per = BATCH // world
    ids = ids[rank * per : (rank + 1) * per]
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the model's state dict (collective for FSDP: every rank must call)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = t.detach().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the common keys (inf if the key sets differ)."""
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class Timer:
    """``with Timer(results, "save_s"): ...`` stores the elapsed seconds."""

    def __init__(self, results: dict, key: str):
        self.results, self.key = results, key

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.results[self.key] = round(time.perf_counter() - self.t0, 3)


def write_results(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=2)
    os.replace(path + ".tmp", path)
