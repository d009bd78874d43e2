"""The slow tier's worker groups (``tests/conftest.py``) and the durations table they are ordered by
(``tests/support/durations.py``), on stand-in test items."""

from __future__ import annotations

import types

from tests.conftest import xdist_groups
from tests.support.durations import durations


def _item(nodeid: str, fixtures: dict[str, str]):
    """A collected test as the grouping reads it: node id, module, fixture names and scopes."""
    module = nodeid.split("::")[0].removesuffix(".py").replace("/", ".")
    defs = {name: [types.SimpleNamespace(scope=scope)] for name, scope in fixtures.items()}
    return types.SimpleNamespace(
        nodeid=nodeid,
        module=types.SimpleNamespace(__name__=module),
        fixturenames=list(fixtures),
        _fixtureinfo=types.SimpleNamespace(name2fixturedefs=defs),
    )


def test_what_tests_share_keeps_them_together_and_the_rest_is_free():
    items = [
        _item("tests/a.py::t1", {"base_run": "session", "tmp_path": "function"}),
        _item("tests/a.py::t2", {"engine": "module"}),
        _item("tests/a.py::t3", {"engine": "module", "tmp_path": "function"}),
        _item("tests/a.py::t4", {"tmp_path": "function", "prefect_harness": "session"}),
        _item("tests/b.py::t1", {"base_run": "session"}),
        _item("tests/b.py::t2", {"engine": "module"}),  # b's own module fixture, not a's
        _item("tests/c.py::t1", {"light_run": "session", "engine": "module"}),
        _item("tests/c.py::t2", {"engine": "module"}),
    ]
    g = xdist_groups(items)
    assert g["tests/a.py::t1"] == g["tests/b.py::t1"] == "base_run"  # one shared run, built once
    assert g["tests/a.py::t2"] == g["tests/a.py::t3"] == "tests.a"  # one module fixture
    assert g["tests/b.py::t2"] == "tests.b.py.t2"  # shares nothing: a group of its own
    assert g["tests/a.py::t4"] == "tests.a.py.t4"  # session fixtures other than the runs: free
    assert g["tests/c.py::t1"] == g["tests/c.py::t2"] == "light_run"  # a run and a module fixture
    assert len(set(g.values())) == 5


def test_the_durations_table_sums_each_tests_phases_without_the_group():
    report = """
============================= slowest durations ==============================
12.50s call     tests/a.py::t1@base_run
3.00s setup    tests/a.py::t1@base_run
0.25s teardown tests/a.py::t1@base_run
1.00s call     tests/b.py::t[x y@z]@tests.b.py.t
(8 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert durations(report) == {"tests/a.py::t1": 15.8, "tests/b.py::t[x y@z]": 1.0}
