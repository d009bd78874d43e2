"""The chunked log-prob head's memory at long lengths: its peak does not grow with vocabulary x
tokens (the (tokens, vocab) logits are never built), measured, not assumed.

How it is measured: each case runs in a fresh Python process (one thread) that builds its inputs,
warms the head up on one chunk of tokens, resets its resident-set high-water mark to what is
resident now (``5`` to ``/proc/self/clear_refs``: the imports' own peak would otherwise hide a
smaller one) and reads it (``VmHWM``), runs
the head forward and backward (log-probs and entropy, the policy update's call), and reads the
high-water mark again. The difference is the peak the computation added. torch's CPU allocator
is glibc's malloc; with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``, which also turns off
glibc's raising of it after a large free) every block over 64 KiB is mapped from the OS on
allocation and unmapped on free, so the mark follows the largest set of tensors alive at once
(without it, freed chunk-sized blocks stay in the heap and the mark grows with the chunk count);
Python's tracemalloc sees none of torch's allocations and the profiler's CPU memory events are not reliable here. A control case (a plain
full log-softmax) shows the measure sees a (tokens, vocab) tensor when there is one.

Shape: 64 hidden, a 16384-token vocabulary, 2048 and 8192 tokens (the responses of a few
long sequences), chunks of 256 tokens: the full float32 logits of 8192 tokens are 512 MiB, one
chunk's 16 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

H, V, CHUNK = 64, 16384, 256
MIB = 2**20

SCRIPT = rf"""
import json, sys
import torch
from ppoflow.workers.lm_head import chunked_log_probs

n, impl = int(sys.argv[1]), sys.argv[2]
H, V, CHUNK = {H}, {V}, {CHUNK}
torch.set_num_threads(1)
torch.manual_seed(0)
head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(n, H, requires_grad=True)
labels = torch.randint(0, V, (n,))

def run(h, y):
    if impl == "full":  # the control: the whole (n, V) logits and their log-softmax
        logp = torch.log_softmax(head(h).float(), -1)
        lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    else:
        lp, ent = chunked_log_probs(h, head, y, 1.0, True, True, CHUNK, impl)
    (lp.sum() + 0.01 * ent.sum()).backward()

def high_water_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

run(hidden[:CHUNK].detach().requires_grad_(True), labels[:CHUNK])  # warm-up: kernels, allocator
head.zero_grad()
with open("/proc/self/clear_refs", "w") as f:  # the mark restarts from what is resident now
    f.write("5")
before = high_water_kib()
run(hidden, labels)
after = high_water_kib()
assert hidden.grad is not None and head.weight.grad is not None
print(json.dumps({{"added_kib": after - before}}))
"""


def added_mib(n: int, impl: str) -> float:
    """Peak memory the head's forward + backward added over its inputs, in MiB (own process)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(n), impl],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["added_kib"] / 1024


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_chunked_head_peak_does_not_grow_with_vocab_times_tokens(impl):
    short, long = added_mib(2048, impl), added_mib(8192, impl)
    full_logits = 8192 * V * 4 / MIB  # 512 MiB
    print(
        f"\n{impl} head: +{short:.0f} MiB at 2048 tokens, +{long:.0f} MiB at 8192 (full logits {full_logits:.0f})"
    )
    # a few chunk-sized (256 x V) float32 blocks of 16 MiB, whatever the length: far below the logits
    assert long < full_logits / 4, long
    # 6144 more tokens add only O(tokens x hidden) (hidden-state gradients): ~1.5 MiB each
    assert long - short < 24, (short, long)


def test_the_measure_sees_full_logits():
    """Control: a plain log-softmax over the whole (2048, V) logits (128 MiB) shows up."""
    added = added_mib(2048, "full")
    print(f"\nfull log-softmax: +{added:.0f} MiB at 2048 tokens (logits {2048 * V * 4 / MIB:.0f} MiB)")
    assert added > 2048 * V * 4 / MIB, added
