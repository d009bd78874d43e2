"""SIGTERM and Ctrl-C in a process of ours, at the two moments that went wrong: in the middle of an
import, and while a command is still starting. Each case runs in a real subprocess that signals
itself (``ppoflow.infra.runtime.signals``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A module whose import catches everything, as some libraries' optional imports do: an exception
# raised by a signal handler inside it would be swallowed and the process would go on.
SWALLOWING_MODULE = """
import os, time
try:
    os.kill(os.getpid(), {signum})
    time.sleep(0.5)  # the handler runs here, inside this module's import
except:  # noqa: E722
    print("SWALLOWED", flush=True)
print("IMPORTED", flush=True)
"""

MAIN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from ppoflow.infra.runtime.signals import install_stop_handlers
install_stop_handlers()
try:
    import swallowing
    time.sleep(30)
    print("NOT STOPPED", flush=True)
except KeyboardInterrupt:
    sys.exit(130)
finally:
    print("CLEANUP RAN", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_inside_an_import_is_raised_once_the_import_is_done(tmp_path, signum):
    (tmp_path / "swallowing.py").write_text(SWALLOWING_MODULE.format(signum=int(signum)))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MAIN, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    # not swallowed inside the import, raised right after it: the finally block ran, 143 / 130
    assert proc.returncode == 128 + signum, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.split() == ["IMPORTED", "CLEANUP", "RAN"], proc.stdout
    assert "Traceback" not in proc.stderr and took < 20


EXIT_AT_ONCE = """
import time
from ppoflow.infra.runtime.signals import exit_while_starting
exit_while_starting("run")
print("READY", flush=True)
try:
    time.sleep(30)
finally:
    print("CLEANUP RAN", flush=True)
"""


@pytest.mark.parametrize(
    "signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")], ids=["SIGTERM", "Ctrl-C"]
)
def test_while_starting_a_signal_ends_the_process_at_once_with_its_line(signum, name):
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_AT_ONCE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "READY"
    t0 = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum and time.monotonic() - t0 < 5
    assert err.strip() == f"ppoflow: stopped by {name} while starting (run had not begun)"
    assert "CLEANUP" not in out


def test_install_stop_handlers_replaces_exit_while_starting():
    code = textwrap.dedent(
        """
        import os, signal, time
        from ppoflow.infra.runtime.signals import Terminated, exit_while_starting, install_stop_handlers
        exit_while_starting("run")
        install_stop_handlers()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Terminated as exc:
            print("TERMINATED", exc.code)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("INTERRUPTED")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.split() == ["TERMINATED", "143", "INTERRUPTED"], (proc.stdout, proc.stderr)
