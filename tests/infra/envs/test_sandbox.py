"""The ``python`` tool's sandbox: it runs code in a fresh folder and a minimal environment, stops
what it must (endless loops, allocations over its limit, the network, new processes) and leaves
nothing running (tests/infra/envs/conftest.py checks after every module)."""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.envs.sandbox import run_python
from tests.support.sandbox import sandbox_processes


def test_sandbox_runs_code_and_prints_the_last_expression():
    assert run_python("x = 6\nprint(x)\nx * 7").output == "6\n42\n"
    res = run_python("import os\nprint(os.listdir('.'), os.environ.get('PYTHONPATH'))")
    assert res.ok and res.output.strip() == "[] None"  # a fresh empty folder, a minimal environment


def test_sandbox_stops_an_endless_loop_and_leaves_nothing_running():
    t0 = time.monotonic()
    res = run_python("while True:\n    pass", timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert not res.ok and res.timed_out and "longer than 1 s" in res.output
    assert sandbox_processes() == []


def test_sandbox_stops_an_allocation_over_its_memory_limit():
    res = run_python("x = bytearray(2 * 1024 ** 3)\nlen(x)", memory_mb=256)
    assert not res.ok and "MemoryError" in res.output and "256 MB" in res.output
    assert sandbox_processes() == []


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import _socket\n_socket.socket()",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
    ],
)
def test_sandbox_refuses_the_network_and_new_processes(code):
    res = run_python(code)
    assert not res.ok and "not allowed" in res.output, res.output


def test_sandbox_reports_the_code_s_own_error():
    res = run_python("1 / 0")
    assert not res.ok and res.output == "Error: ZeroDivisionError: division by zero"
