"""infra/runtime/host_cpu.py: the CPU a stretch of work got (the thread's own, the host's busy and stolen shares)."""

from __future__ import annotations

import time

import pytest

from ppoflow.infra.runtime.host_cpu import CpuTimes, cpu_use, parse_cpu_times, read_cpu_times

# /proc/stat as Linux writes it: user nice system idle iowait irq softirq steal guest guest_nice
STAT = "cpu  {} 0 {} {} {} 0 {} {} 7 0\ncpu0 1 2 3 4 5 6 7 8 0 0\nintr 12345 0 0\nctxt 99\n"


def stat(user, system, idle, iowait, softirq, steal):
    return STAT.format(user, system, idle, iowait, softirq, steal)


def test_the_aggregate_line_is_read_and_guest_time_is_not_counted_twice():
    t = parse_cpu_times(stat(100, 50, 400, 20, 5, 25))
    # busy = user + nice + system + irq + softirq (guest's 7 is inside user already); idle = idle + iowait
    assert t == CpuTimes(busy=155, idle=420, steal=25) and t.total == 600
    # an old kernel's line without steal and guest columns
    assert parse_cpu_times("cpu  10 0 5 80 5 0 0\n") == CpuTimes(busy=15, idle=85, steal=0)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_cpu_times("cpu0 1 2 3 4\n")


def test_shares_over_a_block_are_the_differences_of_the_two_readings(tmp_path):
    path = tmp_path / "stat"
    path.write_text(stat(100, 50, 400, 20, 5, 25))
    with cpu_use(str(path)) as use:
        # over the block: +60 user, +10 system, +100 idle, +0 iowait, +0 softirq, +30 steal = 200 ticks
        path.write_text(stat(160, 60, 500, 20, 5, 55))
    assert use.host_busy == pytest.approx(70 / 200) and use.host_steal == pytest.approx(30 / 200)
    assert set(use.metrics("perf/x_")) == {"perf/x_thread_cpu_s", "perf/x_host_busy", "perf/x_host_steal"}


def test_without_proc_stat_only_the_thread_is_measured(tmp_path):
    assert read_cpu_times(str(tmp_path / "missing")) is None
    with cpu_use(str(tmp_path / "missing")) as use:
        pass
    assert use.host_busy is None and use.host_steal is None
    assert list(use.metrics("perf/x_")) == ["perf/x_thread_cpu_s"]


@pytest.mark.skipif(read_cpu_times() is None, reason="needs Linux's /proc/stat")
def test_a_spinning_thread_and_a_sleeping_one_are_told_apart():
    cpus = sum(1 for line in open("/proc/stat") if line.startswith("cpu") and line[3].isdigit())
    with cpu_use() as spin:  # spin until the thread has run 0.3 s (other load may delay it) and 0.5 s passed
        start, end = time.thread_time(), time.perf_counter() + 0.5
        while time.perf_counter() < end or time.thread_time() - start < 0.3:
            pass
    with cpu_use() as sleep:
        time.sleep(0.5)
    # the spinning thread ran at least its 0.3 s, the sleeping one next to none
    assert spin.wall_s >= 0.5 and 0.3 <= spin.thread_cpu_s <= spin.wall_s + 0.01
    assert sleep.wall_s >= 0.5 and sleep.thread_cpu_s < 0.05
    # the host was busy at least with the spinning thread: one CPU of ``cpus`` (ticks are 10 ms: slack)
    assert 0.5 / cpus <= spin.host_busy <= 1 and 0 <= spin.host_steal <= 1
