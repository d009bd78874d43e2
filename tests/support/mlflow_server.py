"""A real MLflow tracking server for tests: ``mlflow server`` on 127.0.0.1, from its own venv.

The full ``mlflow`` package (the server) pins ``pyarrow<26``, which the project's venv does not
have, so it lives in a venv of its own, built once with pip and kept between test sessions
(:mod:`tests.support.prefetch`, which ``.ci/run`` starts ahead of the tests). ``mlflow_server`` (session
scope) starts ``mlflow server`` with a SQLite backend store (tracking and the model registry), serving the
artifacts itself (clients upload over HTTP to a local directory), on a free port, waits until it answers, yields ``MlflowServer`` and stops it at
the end. The test is skipped only when the venv cannot be built because PyPI is unreachable.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.prefetch import MLFLOW_VERSION, mlflow_venv


def server_venv() -> Path:
    """The venv with ``mlflow`` (built on first use, under a file lock: :mod:`tests.support.prefetch`)."""
    venv = mlflow_venv()
    if venv is None:
        pytest.skip(f"mlflow=={MLFLOW_VERSION} for the test server: PyPI is unreachable")
    return venv


@dataclass
class MlflowServer:
    uri: str
    process: subprocess.Popen
    log: Path

    def stop(self) -> None:
        """Stop the server (its whole process group: the web workers too)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


def start_server(workdir: Path) -> MlflowServer:
    """``mlflow server`` on a free port of 127.0.0.1 with its stores in ``workdir``; answers."""
    venv = server_venv()
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "server.log"
    cmd = [
        str(venv / "bin" / "python"),
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{workdir / 'mlflow.db'}",
        "--artifacts-destination",
        str(workdir / "artifacts"),
    ]
    # MLflow's job runner (a pool of huey consumers polling the store) is for MLflow's own jobs,
    # which ppoflow never submits; left on, it costs a few % of a core for the rest of the session.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    server = MlflowServer(f"http://127.0.0.1:{port}", process, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mlflow server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{server.uri}/health", timeout=2).close()
            return server
        except OSError:
            time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"mlflow server did not answer in 120 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()
