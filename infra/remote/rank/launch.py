"""The process that launches a group's ranks on one host: torch's own launcher, run in a process
that imports the ranks' code once and forks them from it.

``python -m ppoflow.infra.remote.rank.launch <torchrun flags>`` (what
``ppoflow.infra.remote.procs.torchrun_command`` writes) hands its flags to ``torch.distributed.run``
with the rank program appended:

- **CPU groups** (``PPOFLOW_DEVICE=cpu``): the rank entry and the module of the group's worker
  (``PPOFLOW_WORKER``: torch, FSDP2 and DTensor, which pulls in ``torch._dynamo``, the model code)
  are imported here, once, and the ranks are forked from this process (``--start-method fork
  --run-path`` of :mod:`ppoflow.infra.remote.rank.__main__`). A rank then starts without importing
  anything: a 2-rank group's start takes about 3.9 CPU-seconds instead of 9.3-10 (torch, DTensor and
  the worker imported by each rank), which is most of what a short CPU run spends starting groups.
  The driver may name more modules in ``PPOFLOW_PRELOAD`` (``procs.PRELOAD_ENV``): a group whose
  ranks build a rollout engine names the engine's ``preload`` (vLLM's ``LLM``), imported here once
  instead of by each rank. On a 2-core host a one-group 2-iteration flow's processes took 24.7
  CPU-seconds with vLLM imported here against 33.7 with both ranks importing it; a start alone on an
  idle host takes about the same wall time (the ranks imported it side by side), on busy cores the
  CPU-seconds saved are wall seconds.
- **CUDA groups**: each rank is its own ``python -m ppoflow.infra.remote.rank.entry`` (torchrun's
  default). A forked child may not use CUDA that its parent initialised, and the worker modules are
  not promised never to touch the device at import; a GPU rank's start is small beside its engine's.

Nothing here runs device code or starts threads before the fork. The ranks of a forked group share
this process's session, so killing the launcher's process group (``kill_process_group``) takes
them with it.

Once torch's launcher returns (every rank exited and was collected), this process flushes its output
and exits at once: the interpreter's teardown of what it imported (torch, vLLM) took 1-3 s on a
2-core host, which a group's shutdown waited for.
"""

from __future__ import annotations

import importlib
import os
import sys

from ppoflow.infra.remote.procs import PRELOAD_ENV, RANK_MODULE

__all__ = ["forks_ranks", "torchrun_argv", "main"]

#: The file a forked rank runs (``--run-path``); a spawned one runs ``-m RANK_MODULE``.
_RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")


def forks_ranks(env: dict[str, str] | os._Environ[str]) -> bool:
    """True if the ranks of a group launched with environment ``env`` are forked from the launcher."""
    return env.get("PPOFLOW_DEVICE", "cpu") == "cpu"


def torchrun_argv(flags: list[str], env: dict[str, str] | os._Environ[str]) -> list[str]:
    """torchrun's arguments: ``flags`` and the rank program, forked or spawned (module docstring)."""
    if forks_ranks(env):
        return [*flags, "--start-method", "fork", "--run-path", _RANK_MAIN]
    return [*flags, "-m", RANK_MODULE]


def _preimport(env: dict[str, str] | os._Environ[str]) -> None:
    """Import what every forked rank needs: the entry and the module of the group's worker; and
    ``torch._dynamo``, which torch's launcher imports to report a failed rank (1-2 s of a CPU, 6 s
    on a busy 2-core machine: past the driver's wait for the report) unless the worker has it."""
    importlib.import_module(RANK_MODULE)
    importlib.import_module("torch._dynamo")
    modules = [env.get("PPOFLOW_WORKER", "").partition(":")[0]]
    modules += [name.strip() for name in env.get(PRELOAD_ENV, "").split(",") if name.strip()]
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - each rank imports it again and reports the error to the driver
            pass


def main(argv: list[str] | None = None) -> None:
    flags = list(sys.argv[1:] if argv is None else argv)
    if forks_ranks(os.environ):
        _preimport(os.environ)
    from torch.distributed.run import main as torchrun

    torchrun(torchrun_argv(flags, os.environ))
    # (a failed rank raises out of torchrun above: that exit keeps torch's own error report)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
