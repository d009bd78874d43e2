"""Run untrusted Python in a child process with limits: the built-in ``python`` tool's sandbox.

    result = run_python("print(2 ** 10)", timeout_s=5, memory_mb=512)   # SandboxResult(ok, output)

What it does:
- a fresh interpreter (``python -I``: no user site, no PYTHONPATH, no current directory on the
  path) in a new, empty temporary working directory (removed afterwards), with a minimal
  environment (PATH, HOME = that directory, LANG), in its own session (process group);
- ``resource.setrlimit`` in the child before the code runs: address space (``memory_mb``), CPU
  seconds, file size (1 MiB), open files, core dumps off;
- a Python audit hook, installed before the code runs, that refuses sockets, new processes
  (subprocess, os.system, exec, fork, spawn) and ctypes;
- the wall-clock ``timeout_s``: on expiry the whole process group is killed (SIGKILL) and waited
  for, so nothing is left running; the output so far is discarded and the model is told it timed out.

What it does not guarantee: it is not a security boundary against a determined attacker. The
audit hook acts at the Python level (code that reaches native code another way could bypass it),
and there are no namespaces, seccomp filters or chroot: the code can read the files the rank's
user can read. Use it for a model's arithmetic and small scripts, not for code meant to harm the
host; run the training in a container when that matters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_python", "RUNNER"]

#: The child's program: limits, the audit hook, then the code from stdin; a last expression's
#: value is printed like the interactive interpreter does (a calculator).
RUNNER = r"""
import ast, resource, sys
mem, cpu = int(sys.argv[1]), int(sys.argv[2])
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, 1 << 20),
                 (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (val, val))
code = sys.stdin.read()
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn",
         "os.spawn", "pty.", "ctypes.")
def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
tree = ast.parse(code, "<tool>", "exec")
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
ns = {"__name__": "__main__"}
exec(compile(tree, "<tool>", "exec"), ns)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), ns)
    if value is not None:
        print(repr(value))
"""


@dataclass(frozen=True)
class SandboxResult:
    """``ok``: the code ran to the end; ``output``: its stdout (and stderr on failure), or why it
    was stopped; ``timed_out``: the wall-clock limit killed it."""

    ok: bool
    output: str
    timed_out: bool = False


def _last_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "the process failed without a message"


def run_python(
    code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_chars: int = 4000
) -> SandboxResult:
    """Run ``code`` in the sandbox (see the module docstring); never raises for the code's faults."""
    with tempfile.TemporaryDirectory(prefix="ppoflow-tool-") as cwd:
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        cpu_s = max(1, int(timeout_s) + 1)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", RUNNER, str(memory_mb * 2**20), str(cpu_s)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
        )
        try:
            out, err = proc.communicate(code, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return SandboxResult(
                False, f"Error: the code ran longer than {timeout_s:g} s and was stopped", True
            )
        finally:
            _kill_group(proc)  # anything the code left in its process group
    if proc.returncode == 0:
        return SandboxResult(True, out[:max_chars])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        why = "its CPU time limit" if name == "SIGXCPU" else f"signal {name}"
        return SandboxResult(False, f"Error: the code was stopped by {why}")
    tail = _last_error_line(err)
    if "MemoryError" in tail:
        tail = f"MemoryError: the code needed more than the {memory_mb} MB it may use"
    return SandboxResult(False, f"Error: {tail}"[:max_chars])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError):
        proc.kill()
        proc.wait()
