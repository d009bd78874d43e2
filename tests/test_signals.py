"""SIGTERM in a process of ours, at the two moments that went wrong: in the middle of an import,
and while a command is still starting. Each case runs in a real subprocess that signals itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

# A module whose import catches everything, as some libraries' optional imports do: an exception
# raised by a signal handler inside it would be swallowed and the process would go on.
SWALLOWING_MODULE = """
import os, signal, time
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # the handler runs here, inside this module's import
except:  # noqa: E722
    print("SWALLOWED", flush=True)
print("IMPORTED", flush=True)
"""

MAIN = """
import sys, time
sys.path.insert(0, sys.argv[1])
from ppoflow.flows.signals import install_sigterm_handler
install_sigterm_handler()
try:
    import swallowing
    time.sleep(30)
    print("NOT STOPPED", flush=True)
finally:
    print("CLEANUP RAN", flush=True)
"""


def test_a_sigterm_inside_an_import_is_raised_once_the_import_is_done(tmp_path):
    (tmp_path / "swallowing.py").write_text(SWALLOWING_MODULE)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MAIN, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - t0
    lines = proc.stdout.split()
    # not swallowed inside the import, raised right after it: the finally block ran, exit 143
    assert proc.returncode == 143, (proc.returncode, proc.stdout, proc.stderr)
    assert lines == ["IMPORTED", "CLEANUP", "RAN"], proc.stdout
    assert "Traceback" not in proc.stderr and took < 20


EXIT_AT_ONCE = """
import time
from ppoflow.flows.signals import exit_on_sigterm
exit_on_sigterm("stopped while starting")
print("READY", flush=True)
try:
    time.sleep(30)
finally:
    print("CLEANUP RAN", flush=True)
"""


def test_exit_on_sigterm_ends_the_process_at_once_with_its_line():
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_AT_ONCE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "READY"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - t0 < 5
    assert err.strip() == "stopped while starting" and "CLEANUP" not in out


def test_install_sigterm_handler_replaces_exit_on_sigterm():
    code = textwrap.dedent(
        """
        import os, signal
        from ppoflow.flows.signals import Terminated, exit_on_sigterm, install_sigterm_handler
        exit_on_sigterm("at once")
        install_sigterm_handler()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            import time; time.sleep(5)
        except Terminated as exc:
            print("TERMINATED", exc.code)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.split() == ["TERMINATED", "143"], (proc.stdout, proc.stderr)
