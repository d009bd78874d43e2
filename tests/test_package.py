"""The project as a whole: one installed package, ``ppoflow``, whose layers import downward only
(flows -> tasks -> algos, infra in the flow's process; workers -> algos, infra in the ranks), with
no import circles, and whose flow process loads no worker code (the ranks do)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import ppoflow
from tests.support.paths import ROOT

PACKAGES = ("cli", "flows", "tasks", "workers", "algos", "infra", "demo")


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    out["ppoflow." + rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _imports(path: str, modules: dict[str, str] | None = None) -> set[str]:
    """Every ``ppoflow`` module ``path`` imports, at the top or inside a function. ``from pkg
    import mod`` counts as an import of ``pkg.mod`` (``pkg`` is initialised before either)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppoflow"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            known = {m for m in subs if modules is not None and m in modules}
            found |= known or {node.module}
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ppoflow"))
    return found


def test_lower_layers_never_import_upper_ones():
    rules = {
        "ppoflow.algos": (
            "ppoflow.flows",
            "ppoflow.tasks",
            "ppoflow.workers",
            "ppoflow.demo",
            "ppoflow.infra",
        ),
        "ppoflow.infra": ("ppoflow.flows", "ppoflow.tasks", "ppoflow.workers", "ppoflow.demo"),
        "ppoflow.workers": ("ppoflow.flows", "ppoflow.tasks", "ppoflow.demo"),
        "ppoflow.tasks": ("ppoflow.flows", "ppoflow.demo", "ppoflow.workers"),
        "ppoflow.flows": ("ppoflow.workers",),
        "ppoflow.flows.ppo": ("ppoflow.demo",),
    }
    bad = []
    for module, path in _modules().items():
        for layer, forbidden in rules.items():
            if module == layer or module.startswith(layer + "."):
                bad += [(module, i) for i in _imports(path) if i.startswith(forbidden)]
    assert not bad, bad


def test_no_import_circles():
    """No module imports one that imports it back, directly or through others, counting the
    imports inside functions too (a circle there is a circle a reader has to untangle)."""
    modules = _modules()
    graph = {m: {i for i in _imports(p, modules) if i in modules and i != m} for m, p in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(nxt) :] + [node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


@pytest.mark.slow  # builds a wheel (~15 s)
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
        "ppoflow/cli/main.py",
        "ppoflow/flows/ppo.py",
        "ppoflow/tasks/step.py",
        "ppoflow/workers/rollout/vllm_rollout.py",
        "ppoflow/algos/advantages.py",
        "ppoflow/infra/data/dataproto.py",
        "ppoflow/infra/remote/rank/entry.py",
        "ppoflow/infra/remote/protocol.py",
        "ppoflow/infra/experiment/manifest.py",
        "ppoflow/infra/checkpoint/sharded.py",
        "ppoflow/demo/task.py",
    ):
        assert module in names, module
    entry_points = zipfile.ZipFile(wheel).read(f"ppoflow-{ppoflow.__version__}.dist-info/entry_points.txt")
    assert b"ppoflow = ppoflow.cli.main:main" in entry_points


def test_no_bare_top_level_modules_import():
    """`import tasks` / `import workers` etc. find nothing of ours outside the checkout's root."""
    code = "import importlib.util as u; print([m for m in ('cli','flows','tasks','workers','infra','algos','demo') if u.find_spec(m)])"
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


def test_the_flow_process_imports_no_worker_code():
    """The driver builds worker groups from import paths and the method tables the ranks send:
    the flow, its tasks and the CLI import nothing of ``ppoflow.workers`` (FSDP models, vLLM,
    packing), so a flow run starts fast and needs no GPU libraries."""
    code = (
        "import sys, ppoflow.cli.main, ppoflow.flows.ppo, ppoflow.flows.deployment, ppoflow.tasks; "
        "print(sorted(m for m in sys.modules if m.startswith('ppoflow.workers') or m == 'vllm'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
