"""Checkpoint costs in one process: synchronous save, background save (what blocks training:
staging to host memory; what runs behind it: the write), verification, and loads with and
without verification. Prints one table.

    python benchmarks/checkpoint_io.py --params-m 150 --dir /tmp/ckpt-bench            # CPU
    python benchmarks/checkpoint_io.py --params-m 500 --device cuda --dir /tmp/ckpt-bench
    python benchmarks/checkpoint_io.py --weights-read qwen2.5-0.5b      # a policy version's read

The model is a stack of fp32 linear layers of ``--params-m`` million parameters with AdamW state
after one step (so a checkpoint is about 12 bytes per parameter, like the flow's actor and
critic). Verification reads every file once and hashes it with XXH3-64; its cost per byte is the
slower of storage reads and the hash (the in-memory hash speed is printed too).

``--weights-read PRESET``: how a rollout engine reads a published policy version (a weights-only
checkpoint of a random model of ``benchmarks/iteration.py``'s preset shape, fp32):
``ppoflow.workers.rollout.weight_sync.checkpoint_weights``' reads of ``READ_BYTES`` against one
read per decoder layer and one read of everything, interleaved, ``--repeats`` times each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from ppoflow.infra.checkpoint.marker import checkpoint_bytes, verify_checkpoint
from ppoflow.infra.checkpoint.sharded import load_checkpoint, save_checkpoint
from ppoflow.infra.checkpoint.writer import CheckpointWriter
from ppoflow.infra.data.hashing import hash_bytes


def build(params_m: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(
        device
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def weights_read(preset: str, work: str, repeats: int) -> str:
    """Seconds to read every weight of a weights-only checkpoint, by read size (see the docstring)."""
    import statistics
    import sys

    from transformers import AutoModelForCausalLM

    from ppoflow.infra.checkpoint.sharded import load_full_state_dict, model_tensor_bytes
    from ppoflow.workers.rollout.weight_sync import READ_BYTES, layer_groups, read_groups

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from iteration import build_model  # beside this script

    build_model(os.path.join(work, "model"), preset, max_len=1024)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "model"), dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    url = save_checkpoint(os.path.join(work, "policy"), model)
    sizes = model_tensor_bytes(url)
    ways = {
        "one read per decoder layer": layer_groups(names),
        f"reads of {READ_BYTES >> 20} MiB (checkpoint_weights)": read_groups(names, sizes),
        "one read of everything": [names],
    }
    seconds: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats):
        for way, reads in ways.items():
            t0 = time.perf_counter()
            for keys in reads:
                load_full_state_dict(url, keys=keys)
            seconds[way].append(time.perf_counter() - t0)
    gb = sum(sizes[n] for n in names) / 1e9
    lines = [
        f"reading a policy version: {preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"params, {gb:.2f} GB fp32, from {work}; {repeats} rounds, interleaved",
        "",
        f"{'how':<44}{'reads':>6}{'median s':>10}   each",
    ]
    for way, reads in ways.items():
        each = " ".join(f"{x:.2f}" for x in seconds[way])
        lines.append(f"{way:<44}{len(reads):>6}{statistics.median(seconds[way]):>10.2f}   {each}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-m", type=float, default=50.0, help="million parameters")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--weights-read", metavar="PRESET", default=None, help="time a policy version's read")
    p.add_argument("--repeats", type=int, default=5, help="--weights-read: rounds")
    args = p.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="ppoflow-ckpt-bench-")
    os.makedirs(work, exist_ok=True)
    if args.weights_read:
        print(weights_read(args.weights_read, work, args.repeats))
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
        return
    model, opt = build(args.params_m, args.device)
    n_params = sum(t.numel() for t in model.parameters())

    sync_s, _ = timed(lambda: save_checkpoint(os.path.join(work, "sync"), model, opt))
    size = checkpoint_bytes(verify_checkpoint(os.path.join(work, "sync"), deep=False))
    writer = CheckpointWriter()
    rows = []
    for i in range(3):  # the first background save allocates (and on CUDA pins) the host buffers
        url = os.path.join(work, f"bg{i}")
        staged_s, _ = timed(lambda url=url: writer.save(url, model, opt, background=True))
        result = writer.wait()
        rows.append((staged_s, result["write_s"]))
    writer.close()
    verify_s, _ = timed(lambda: verify_checkpoint(os.path.join(work, "bg2")))
    data = os.urandom(256 << 20)
    hash_s, _ = timed(lambda: hash_bytes(data))
    fresh, fresh_opt = build(args.params_m, args.device)
    load_s, _ = timed(lambda: load_checkpoint(os.path.join(work, "bg2"), fresh, fresh_opt, verify=False))
    fresh, fresh_opt = build(args.params_m, args.device)
    load_v_s, _ = timed(lambda: load_checkpoint(os.path.join(work, "bg2"), fresh, fresh_opt, verify=True))

    gb = size / 1e9
    lines = [
        f"checkpoint I/O: {n_params / 1e6:.0f}M params on {args.device}, {gb:.2f} GB per checkpoint "
        f"(model + AdamW), to {work}",
        "",
        f"{'what':<52}{'seconds':>10}{'GB/s':>8}",
        f"{'synchronous save (blocks training)':<52}{sync_s:10.3f}{gb / sync_s:8.2f}",
    ]
    for i, (staged_s, write_s) in enumerate(rows):
        note = " (first: allocates buffers)" if i == 0 else ""
        lines.append(
            f"{'background save ' + str(i + 1) + ': staging' + note:<52}{staged_s:10.3f}{gb / staged_s:8.2f}"
        )
        lines.append(f"{'  write behind it':<52}{write_s:10.3f}{gb / write_s:8.2f}")
    lines += [
        f"{'verify_checkpoint (read + xxh3 every file)':<52}{verify_s:10.3f}{gb / verify_s:8.2f}",
        f"{'xxh3_64 in memory (256 MiB)':<52}{hash_s:10.3f}{0.268 / hash_s:8.2f}",
        f"{'load without verification':<52}{load_s:10.3f}{gb / load_s:8.2f}",
        f"{'load with verification':<52}{load_v_s:10.3f}{gb / load_v_s:8.2f}",
    ]
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "checkpoint_io.txt"), "w") as f:
            f.write(text + "\n")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
