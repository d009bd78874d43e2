"""The checkpoint tests' shared work: one tiny model, a 1-process checkpoint ``c1`` after step 1,
then torchrun jobs (tests/support/ckpt/ckpt_ranks.py): 2 ranks (save ``c2``; 2->2, 1->2 and S3
round trips), 4 ranks as a 2x2 HSDP mesh (2->4, save ``c4``), 2 ranks saving in the background
while training goes on (with injected storage failures), and 2 ranks of which one is killed while
it writes. The ``ckpt_run`` fixture (registered in tests/conftest.py) runs them once per session
for tests/infra/checkpoint/, whose tests assert on their results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.checkpoint import sharded as ck
from tests.support.ckpt.common import full_params, make_optim, train_step
from tests.support.paths import ROOT

SCRIPT = os.path.join(ROOT, "tests", "support", "ckpt", "ckpt_ranks.py")
#: Same world size: bit-exact; across world sizes the gradients are reduced in another order, so
#: the step after a load is compared to this.
TOL = 1e-6


def torchrun(
    nprocs: int, *args: str, env: dict | None = None, timeout: float = 240, expect_ok: bool = True
) -> float:
    """Run the rank script under torchrun; fail with its output tail (unless ``expect_ok`` is
    False: then it must fail). Returns the wall time."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "--max-restarts=0",
        SCRIPT,
        *args,
    ]
    full_env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, f"torchrun {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    else:
        assert proc.returncode != 0 and "injected fault" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    return time.perf_counter() - t0


def plain_model(work: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(work, "base"))


@pytest.fixture(scope="session")
def ckpt_run(tmp_path_factory, s3_server):
    """The shared work dir after the in-process c1 save and both torchrun jobs."""
    torch.set_num_threads(1)
    work = str(tmp_path_factory.mktemp("ckpt"))
    save_tiny_model(os.path.join(work, "base"))
    model = plain_model(work)
    opt, sched = make_optim(model)
    train_step(model, opt, sched, 1)
    ck.save_checkpoint(os.path.join(work, "c1"), model, opt, sched, extra={"iteration": 1})
    train_step(model, opt, sched, 2)
    save_file(full_params(model), os.path.join(work, "ref2_1rank.safetensors"))
    s3_url = s3_server["url"] + "/ckpt/ranks2"
    wall = {"save": torchrun(2, "save", work, env={"CKPT_S3_URL": s3_url})}
    wall["hsdp"] = torchrun(4, "hsdp", work)
    wall["async"] = torchrun(2, "async", work)
    wall["killed"] = torchrun(
        2, "killed", work, env={"PPOFLOW_FAULT": "rank_exit:checkpoint_write:1"}, expect_ok=False
    )
    results = {m: json.load(open(os.path.join(work, f"results_{m}.json"))) for m in ("save", "hsdp", "async")}
    print(f"\ncheckpoint timings: torchrun wall {wall}; in-rank {results}")
    return {"work": work, "results": results, "s3_url": s3_url}
