"""``benchmarks/gpu_check.py`` on CPU: the real flow on 2 gloo ranks with vLLM's CPU build at TP=2
(one engine replica over both ranks, training data-parallel over both), float32, a small Qwen2
shape (head_dim 64); iterations 1-2 in one flow run and 3 in a second.

The script is run as a user runs it (a subprocess, its exit status, its JSON line), against the
session's Prefect API (``PREFECT_API_URL``, as a user with a server runs it: no temporary server of
its own to start). Its references are independent of the flow: transformers forwards of
``ppoflow export-hf --iteration n-1``. The test asserts what the script reports (every comparison
within the float32 tolerance, exit 0) and that the check has power: each stale control (the
weights one iteration older) is far outside the tolerance, so an engine that missed one update
would have failed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.cpu_tp]


def test_gpu_check_passes_on_cpu_tp2(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    cmd = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--ranks", "2", "--tp", "2"]
    env = {**os.environ, "PPOFLOW_RANK_THREADS": "1", "OUT": str(tmp_path)}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("gpu_check: {"))
    result = json.loads(line[len("gpu_check: ") :])
    with open(tmp_path / "gpu_check.json") as f:
        assert json.load(f)["verdict"] == result["verdict"] == "PASS"
    rows = result["rows"]
    assert sorted({r["iteration"] for r in rows}) == [1, 2, 3]
    tol_mean, tol_max = result["args"]["tol_mean"], result["args"]["tol_max"]
    assert (tol_mean, tol_max) == (1e-5, 1e-4) and result["args"]["dtype"] == "fp32"
    right = [r for r in rows if "stale" not in r["pair"]]
    stale = [r for r in rows if "stale" in r["pair"]]
    assert len(right) == 9 and len(stale) == 2
    for r in right:
        assert r["tokens"] > 0 and r["mean"] <= tol_mean and r["max"] <= tol_max, r
    for r in stale:
        assert r["separated"] and r["mean"] > 100 * tol_mean, r
    print(f"\ngpu_check on CPU (TP 2): {wall:.0f} s\n" + "\n".join(proc.stdout.splitlines()[-22:-1]))
