"""The layering rules, read from the source: flows -> tasks -> workers -> algos, infra; the demo
out of the runtime path; no import circles between modules (top-level imports)."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("flows", "tasks", "workers", "algos", "infra", "demo")


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                    out["ppoflow." + rel.removesuffix(".__init__")] = os.path.join(folder, name)
    return out


def _imports(path: str, top_level_only: bool) -> set[str]:
    tree = ast.parse(open(path).read())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppoflow"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
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
        "ppoflow.tasks": ("ppoflow.flows", "ppoflow.demo"),
        "ppoflow.flows.ppo": ("ppoflow.demo",),
    }
    bad = []
    for module, path in _modules().items():
        for layer, forbidden in rules.items():
            if module == layer or module.startswith(layer + "."):
                bad += [(module, i) for i in _imports(path, top_level_only=False) if i.startswith(forbidden)]
    assert not bad, bad


def test_no_import_circles():
    modules = _modules()
    graph = {
        m: {i for i in _imports(p, top_level_only=True) if i in modules and i != m}
        for m, p in modules.items()
    }
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
