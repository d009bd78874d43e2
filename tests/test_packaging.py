"""The project installs as one package, ``ppoflow``: a built wheel holds nothing else at the top
level of site-packages, and every sub-package maps onto its repository folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import ppoflow

pytestmark = pytest.mark.slow  # builds a wheel (~15 s)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_puts_only_ppoflow_at_the_top_level(tmp_path):
    src = tmp_path / "src"  # build from a copy: setuptools leaves build/ in the tree it builds
    skip = shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info", ".gpu-*", "__pycache__")
    shutil.copytree(ROOT, src, ignore=skip)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path),
        ".",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=src)
    (wheel,) = tmp_path.glob("ppoflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ppoflow", f"ppoflow-{ppoflow.__version__}.dist-info"}
    for module in (
        "ppoflow/flows/ppo.py",
        "ppoflow/tasks/step.py",
        "ppoflow/workers/rollout/vllm_rollout.py",
        "ppoflow/algos/advantages.py",
        "ppoflow/infra/data/dataproto.py",
        "ppoflow/infra/remote/rank/entry.py",
        "ppoflow/infra/experiment/manifest.py",
        "ppoflow/infra/checkpoint/sharded.py",
        "ppoflow/demo/task.py",
    ):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(f"ppoflow-{ppoflow.__version__}.dist-info/entry_points.txt")
    assert b"ppoflow = ppoflow.flows.cli:main" in entry_points


def test_no_bare_top_level_modules_import():
    """`import tasks` / `import workers` etc. find nothing of ours outside the checkout's root."""
    code = "import importlib.util as u; print([m for m in ('flows','tasks','workers','infra','algos','demo') if u.find_spec(m)])"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    out = subprocess.run(
        [sys.executable, "-c", "import ppoflow.flows.ppo, ppoflow.infra.remote.rank.entry; print('ok')"],
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "ok"
