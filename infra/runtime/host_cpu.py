"""How much CPU a stretch of work got: the host's CPUs (busy, stolen) and the calling thread's own.

A decode step of vLLM at a small model's shape is mostly Python on one thread, so a rollout's speed
follows the CPU it gets: hosts of one kind differ in it as the speed of their cores does (figures:
``docs/internals.md``, ``docs/benchmarks.md``). In a rollout's metrics these figures show a host
that was busy or stolen from:

- ``thread_cpu_s``: CPU seconds of the calling thread (``time.thread_time``). Well below the wall
  time: the thread waited (for the GIL, or for a CPU the host gave to someone else). Near it: the
  thread never slept, which on a GPU does not mean CPU-bound: CUDA's default schedule spins in a
  synchronize while the GPU works; ``benchmarks/speed_probes.py`` times the core and the GPU
  themselves.
- ``host_busy``: share of all CPUs' time the host spent running anything (user, nice, system, irq,
  softirq) over the stretch, from ``/proc/stat``; ``host_steal``: share the hypervisor gave to other
  guests (a virtual machine's noisy neighbours). Both None where there is no ``/proc/stat``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["CpuTimes", "parse_cpu_times", "read_cpu_times", "CpuUse", "cpu_use"]

PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """The host's CPU time so far, all CPUs together, in clock ticks."""

    busy: int
    idle: int
    steal: int

    @property
    def total(self) -> int:
        return self.busy + self.idle + self.steal


def parse_cpu_times(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``: user nice system idle iowait irq softirq steal
    [guest guest_nice]. Guest time is already inside user and nice, so it is not added again."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            return CpuTimes(busy=user + nice + system + irq + softirq, idle=idle + iowait, steal=steal)
    raise ValueError("no aggregate 'cpu' line in /proc/stat's text")


def read_cpu_times(path: str = PROC_STAT) -> CpuTimes | None:
    """This host's CPU times now, or None where ``path`` cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return parse_cpu_times(f.read())
    except (OSError, ValueError):
        return None


@dataclass
class CpuUse:
    """What :func:`cpu_use` measured; filled in when its block ends."""

    wall_s: float = 0.0
    thread_cpu_s: float = 0.0
    host_busy: float | None = None
    host_steal: float | None = None

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}thread_cpu_s``, and ``{prefix}host_busy`` / ``host_steal`` where known."""
        out = {f"{prefix}thread_cpu_s": self.thread_cpu_s}
        if self.host_busy is not None and self.host_steal is not None:  # measured together
            out[f"{prefix}host_busy"] = self.host_busy
            out[f"{prefix}host_steal"] = self.host_steal
        return out


@contextmanager
def cpu_use(path: str = PROC_STAT) -> Iterator[CpuUse]:
    """``with cpu_use() as use: ...``: the block's wall time, the calling thread's CPU time and the
    host's busy and stolen shares over it (filled in when the block ends, also when it raises)."""
    use = CpuUse()
    host, thread, wall = read_cpu_times(path), time.thread_time(), time.perf_counter()
    try:
        yield use
    finally:
        use.wall_s = time.perf_counter() - wall
        use.thread_cpu_s = time.thread_time() - thread
        after = read_cpu_times(path)
        if host is not None and after is not None and after.total > host.total:
            span = after.total - host.total
            use.host_busy = (after.busy - host.busy) / span
            use.host_steal = (after.steal - host.steal) / span
