"""The slow tier's schedule (``tests/conftest.py``): under ``--dist loadgroup`` the groups are handed
out longest first by their recorded seconds, each group's tests together and in collected order;
a slow test without a recorded figure counts as a typical flow test; and the recorded figures name
only tests that exist (a renamed test would otherwise fall back to the default unnoticed)."""

from __future__ import annotations

import ast
import glob
import os
from dataclasses import dataclass

import pytest

from tests import conftest
from tests.support.paths import ROOT


@dataclass(eq=False)
class _Item:
    nodeid: str
    marks: tuple[str, ...] = ("slow",)

    def iter_markers(self):
        return [pytest.Mark(name, (), {}) for name in self.marks]


def test_groups_go_longest_first_and_stay_whole(monkeypatch):
    recorded = {"m.py::a1": 10.0, "m.py::a2": 10.0, "n.py::b": 50.0, "o.py::c": 5.0}
    monkeypatch.setattr(conftest, "_recorded_durations", lambda: recorded)
    a1, a2, b, c = (_Item(k) for k in recorded)
    new = _Item("p.py::d")  # not recorded: UNRECORDED_SLOW_S
    fast = _Item("q.py::e", marks=())  # not recorded, not slow: 0
    items = [a1, c, fast, b, new, a2]
    groups = {a1: "A", a2: "A", b: "B", c: "C", new: "D", fast: "E"}
    conftest._longest_groups_first(items, groups)
    assert conftest.UNRECORDED_SLOW_S == 30.0
    # B 50 s, D 30 s (unrecorded), A 20 s (its two tests together, in collected order), C 5 s, E 0 s
    assert [i.nodeid for i in items] == ["n.py::b", "p.py::d", "m.py::a1", "m.py::a2", "o.py::c", "q.py::e"]


def test_the_recorded_tests_exist():
    """Every node id in ``tests/durations.json`` names a test function of a test module (the
    parametrised ids by their function)."""
    defined = set()
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                defined.add(f"{rel}::{node.name}")
    recorded = conftest._recorded_durations()
    assert recorded, "tests/durations.json is missing or empty"
    stale = sorted(k for k in recorded if k.partition("[")[0] not in defined)
    assert not stale, f"tests/durations.json names tests that no longer exist: {stale[:5]}"
