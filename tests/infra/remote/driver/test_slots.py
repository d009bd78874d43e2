"""Device slots (``ppoflow.infra.remote.driver.slots``): file locks that a dead holder cannot keep.

The reference for "free" is the kernel's own view: a plain ``flock`` taken here on the slot file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ppoflow.infra.config import ConfigError
from ppoflow.infra.remote.driver.slots import device_slots, slot_holders
from tests.support.configs import slots_config
from tests.support.processes import free_by_flock


@pytest.fixture(autouse=True)
def slots_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOFLOW_SLOTS_DIR", str(tmp_path / "slots"))
    monkeypatch.setenv("PPOFLOW_DEVICE_SLOTS", "2")
    return tmp_path / "slots"


def test_a_second_run_waits_names_the_holder_and_starts_when_freed(slots_env):
    logs: list[str] = []
    release = threading.Event()

    def first():
        with device_slots(slots_config(), logs.append, run_id="run-A"):
            release.wait(10)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.time() + 5
    while free_by_flock(slots_env, "cpu", 2) and time.time() < deadline:
        time.sleep(0.01)
    assert free_by_flock(slots_env, "cpu", 2) == []
    assert [h["run"] for h in slot_holders("cpu", 2)] == ["run-A", "run-A"]

    waits: list[str] = []
    threading.Timer(1.0, release.set).start()
    t0 = time.monotonic()
    with device_slots(slots_config(), logs.append, run_id="run-B", wait_log=waits.append, poll_s=0.1) as held:
        waited = time.monotonic() - t0
        assert held["slots"] == [0, 1] and free_by_flock(slots_env, "cpu", 2) == []
    thread.join()
    assert 0.9 < waited < 3.0
    assert len(waits) == 1 and "held by run run-A of /tmp/nowhere/slots" in waits[0]
    assert f"pid {os.getpid()}" in waits[0]
    assert free_by_flock(slots_env, "cpu", 2) == [0, 1]  # given back at the end of the block


HOLDER = """
import sys, time
from tests.support.configs import slots_config
from ppoflow.infra.remote.driver.slots import device_slots
with device_slots(slots_config(), print, run_id="doomed"):
    print("HELD", flush=True)
    time.sleep(600)
"""


def test_slots_of_a_killed_holder_are_free_at_once(slots_env):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        for line in proc.stdout:
            if line.startswith("HELD"):
                break
        assert free_by_flock(slots_env, "cpu", 2) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        with device_slots(slots_config(), print, run_id="next", poll_s=0.05) as held:
            took = time.monotonic() - t0
            assert held["slots"] == [0, 1]
        assert took < 0.5, f"the next run waited {took:.2f} s for the slots of a dead run"
    finally:
        proc.kill()
        proc.wait()


def test_too_many_cuda_ranks_are_refused_and_cpu_ranks_share(slots_env):
    with pytest.raises(
        ConfigError, match="resources.nprocs=4 needs 4 cuda device slots but this machine has 2"
    ):
        with device_slots(slots_config("cuda", 4), print):
            pass
    with device_slots(slots_config("cpu", 4), print) as held:  # more CPU ranks than slots: all of them
        assert held["slots"] == [0, 1] and held["size"] == 2
