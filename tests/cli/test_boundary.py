"""The command line sits on top of the flows: ``ppoflow.cli`` imports the flows, and nothing of
the library (flows, tasks, workers, algos, infra, demo) imports ``ppoflow.cli``, neither in its
source nor when a deployment loads a flow."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.support.paths import ROOT

LIBRARY = ("flows", "tasks", "workers", "algos", "infra", "demo")


def _imports_of_cli(path: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found += [n for n in names if n == "ppoflow.cli" or n.startswith("ppoflow.cli.")]
    return found


def test_no_library_module_imports_the_cli():
    bad = {}
    for pkg in LIBRARY:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    if found := _imports_of_cli(path):
                        bad[os.path.relpath(path, ROOT)] = found
    assert not bad, bad


def test_the_deployments_entrypoints_load_no_cli_module():
    """What ``prefect.yaml`` names (and the ``ppo-eval`` flow) imports, run in a fresh process."""
    code = (
        "import sys, ppoflow.flows.deployment, ppoflow.flows.retrain, ppoflow.flows.evaluate; "
        "print(sorted(m for m in sys.modules if m.startswith('ppoflow.cli')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # and the scan above would see an import of it: the CLI itself is found by the same check
    assert _imports_of_cli(os.path.join(ROOT, "cli", "demo.py"))
