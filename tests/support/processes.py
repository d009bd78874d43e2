"""Processes on this machine, from /proc: what a test checks is left running after a run ends."""

from __future__ import annotations

import fcntl
import os


def _table() -> dict[int, tuple[int, str]]:
    """{pid: (ppid, command line)} of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        table[int(entry)] = (ppid, cmd)
    return table


def descendants(root: int) -> dict[int, str]:
    """{pid: command line} of every process below ``root`` (children, grandchildren, ...)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = {}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out[child] = table[child][1]
                stack.append(child)
    return out


def alive(pids) -> dict[int, str]:
    """The processes of ``pids`` that still run (zombies count as gone), with their command lines."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            out[pid] = cmd
    return out


def free_by_flock(directory, device: str, n: int) -> list[int]:
    """The slots a plain flock can take right now (the kernel's view, not ppoflow's)."""
    free = []
    for i in range(n):
        path = os.path.join(directory, f"{device}-{i}.lock")
        if not os.path.exists(path):
            free.append(i)
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free.append(i)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return free
