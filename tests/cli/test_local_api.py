"""The CLI's own Prefect API server (``ppoflow.cli.local_api``): where it keeps its database, and
what a user reads when it cannot start. Each case runs in a process of its own (the server points
the whole process's Prefect settings at itself). Its life with a CLI run (started with it,
stopped with it, gone after a SIGKILL) is in tests/scenarios/test_failing_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import time
    from ppoflow.cli.local_api import local_server
    server = local_server()
    t0 = time.monotonic()
    try:
        url = server.wait()
        print("ANSWERED", url)
    except RuntimeError as exc:
        print("ERROR", exc)
    finally:
        print(f"AFTER {time.monotonic() - t0:.1f}")
        server.stop()
    """
)


def _start_server(tmp_path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    clean |= {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PPOFLOW_PREFECT_SERVER_TIMEOUT_S": "120"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=clean | env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_prefect_home_that_cannot_be_made_is_named_before_a_server_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = _start_server(tmp_path, PREFECT_HOME=str(blocker / "home"))
    assert "ERROR" in out and "PREFECT_HOME" in out and str(blocker / "home") in out, out
    assert "Set PREFECT_HOME to a writable directory" in out, out
    assert "ANSWERED" not in out


def test_a_prefect_home_whose_parents_are_missing_is_made_with_them(tmp_path):
    """Prefect makes only the last level of ``PREFECT_HOME``; a server started without the rest
    failed on its database (the next test shows how that failure reads)."""
    home = tmp_path / "storage-not-made-yet" / "prefect-home"
    script = "from ppoflow.cli.local_api import _make_prefect_home; _make_prefect_home()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    subprocess.run(
        [sys.executable, "-c", script], env=clean | {"PREFECT_HOME": str(home)}, check=True, timeout=120
    )
    assert home.is_dir()


@pytest.mark.slow
def test_a_server_that_exits_is_told_as_an_exit_with_its_output_not_as_a_timeout(tmp_path):
    database = tmp_path / "no-such-dir" / "prefect.db"  # sqlite makes no directories
    out = _start_server(
        tmp_path,
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{database}",
    )
    assert "ERROR the local Prefect API server exited with status" in out, out
    assert "unable to open database file" in out and "did not answer" not in out, out
    took = float(out.rsplit("AFTER", 1)[1].split()[0])
    assert took < 60, out  # told when it exits, not after the 120 s start timeout
