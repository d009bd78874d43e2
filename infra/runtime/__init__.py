"""What happens to a running process, whichever layer it runs: how it stops, what CPU it got, and
the faults a drill injects into it. Nothing here imports the rest of ppoflow, so the CLI, the
flow's tasks, the checkpoint writer and a rank's entry point all use it from below.

signals.py   SIGTERM / Ctrl-C that end a run cleanly: the handlers a flow's process installs
host_cpu.py  the CPU a stretch of work got: the thread's own, the host's busy and stolen shares
faults.py    fault drills (PPOFLOW_FAULT): a task that fails, a rank or a node that dies, on purpose
"""
