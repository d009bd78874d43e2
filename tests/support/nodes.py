"""Node agents for the multi-node tests: real ``ppoflow agent`` processes on this machine.

Each "node" is a separate ``python -m ppoflow.cli agent`` process dialing the driver on
127.0.0.1 with its own node number; its output goes to a file. Every agent (and so everything it
starts: torchrun, the ranks) carries ``PPOFLOW_TEST_TAG`` in its environment, which is how a test
finds processes left behind without confusing them with other runs on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ppoflow.infra.remote.procs import pid_alive, processes_with_env
from tests.support.paths import ROOT as REPO_ROOT

ROOT = Path(REPO_ROOT)
KEY = "test-cluster-key-" + "0123456789abcdef" * 2


class Agents:
    """Start, kill and inspect ``ppoflow agent`` processes for the driver at ``driver``."""

    def __init__(self, driver: str, log_dir: str | Path, key: str = KEY):
        self.driver, self.key = driver, key
        self.log_dir = Path(log_dir)
        self.tag = uuid.uuid4().hex
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        self.started = 0

    def start(self, node: int, *args: str, key: str | None = None) -> subprocess.Popen:
        """One agent for ``node`` (extra CLI ``args``, or another ``key``)."""
        self.started += 1
        log = self.log_dir / f"agent-node{node}-{self.started}.log"
        env = {**os.environ, "PPOFLOW_CLUSTER_KEY": key or self.key, "PPOFLOW_TEST_TAG": self.tag}
        env.pop("PPOFLOW_CLUSTER_KEY_FILE", None)
        cmd = [sys.executable, "-m", "ppoflow.cli", "agent", "--driver", self.driver]
        cmd += ["--node-rank", str(node), "--advertise-addr", "127.0.0.1", *args]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs[node], self.logs[node] = proc, log
        return proc

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def kill(self, node: int) -> float:
        """SIGKILL ``node``'s agent; returns the time it died (``time.time()``)."""
        proc = self.procs[node]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        return time.time()

    def descendants(self) -> list[int]:
        """Live processes started by these agents (torchrun, ranks), the agents excluded."""
        agents = {p.pid for p in self.procs.values()}
        return [p for p in processes_with_env(PPOFLOW_TEST_TAG=self.tag) if p not in agents and pid_alive(p)]

    def wait_no_descendants(self, timeout: float = 15.0) -> list[int]:
        """Wait until nothing the agents started is alive; returns what is left after ``timeout``."""
        deadline = time.monotonic() + timeout
        left = self.descendants()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.descendants()
        return left

    def stop_all(self) -> None:
        """SIGTERM every agent (they kill their groups), SIGKILL what does not exit."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
