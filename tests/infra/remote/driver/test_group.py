"""WorkerGroup on real ranks: torchrun, gloo collectives, DataProto files on disk.

One module-scoped 2-rank group serves every test that leaves it healthy; each failure test starts
its own group (a failed group is dead by contract), with 1 rank where a second adds nothing to
the path under test. Timings are printed (run with ``-s``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.driver.group import (
    GroupCannotStart,
    RankFailure,
    WorkerGroup,
    WorkerGroupDead,
)
from ppoflow.infra.remote.procs import PRELOAD_ENV, pid_alive
from ppoflow.tasks.step import is_permanent
from tests.support.paths import ROOT
from tests.support.toy_workers import double_plus

pytestmark = pytest.mark.slow

TOY = "tests.support.toy_workers:ToyWorker"


class Lines:
    """A thread-safe ``log`` callable that keeps every line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if any(text in line for line in self.lines):
                    return True
            time.sleep(0.02)
        return False


def assert_all_gone(pids: list[int], timeout: float = 5.0) -> None:
    """Every pid exits (zombies count as gone: PID 1 reaps orphans) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], f"orphans left: {pids}"


def make_proto(n: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict(
        tensors={"x": torch.randn(n, 3, generator=g), "id": torch.arange(n)},
        non_tensors={"name": np.array([f"row{i}" for i in range(n)], dtype=object)},
        meta_info={"source": "test"},
    )


@pytest.fixture(scope="module")
def lines() -> Lines:
    return Lines()


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shutdown") / "bye")


@pytest.fixture(scope="module")
def group(lines, marker):
    t0 = time.monotonic()
    g = WorkerGroup(TOY, nprocs=2, config={"answer": 42, "shutdown_marker": marker}, log=lines, grace_s=1.0)
    with g:
        print(f"\n[timing] group start {time.monotonic() - t0:.2f} s")
        yield g
    assert not g.alive


# ---------------------------------------------------------------------- control plane
def test_one_to_all_runs_on_every_rank(group):
    out = group.call("info")
    assert [r["rank"] for r in out] == [0, 1]
    assert [r["allreduce"] for r in out] == [3.0, 3.0]  # gloo all_reduce of rank + 1
    assert all(r["world_size"] == 2 and r["device"] == "cpu" for r in out)
    assert [r["pid"] for r in out] == group.pids
    assert out[0]["config"]["answer"] == 42
    assert out[0]["threads"] == max(1, (os.cpu_count() or 1) // 2)
    # CPU ranks' OpenMP threads sleep while they wait (unless the caller's environment says otherwise)
    assert {r["omp_wait_policy"] for r in out} == {os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    assert [e.model_dump() for e in group.layout] == [
        {"dp_rank": r, "dp_size": 2, "is_output_rank": True} for r in (0, 1)
    ]


def test_cpu_ranks_are_forked_from_a_launcher_that_imported_their_code(lines):
    # the worker's module, and the modules the group names to preload, were imported once, by
    # the launcher, before it forked the ranks
    env = {PRELOAD_ENV: "tests.support.preloaded"}
    with WorkerGroup(TOY, nprocs=2, config={}, log=lines, env=env) as g:
        out = g.call("process")
        with open(f"/proc/{g.launcher_pid}/cmdline", "rb") as f:
            launcher = f.read().decode().split("\0")
    assert [r["ppid"] for r in out] == [g.launcher_pid] * 2
    assert [r["imported_in"] for r in out] == [g.launcher_pid] * 2
    assert [r["preloaded_in"] for r in out] == [g.launcher_pid] * 2
    assert all(r["cmdline"] == launcher for r in out) and "ppoflow.infra.remote.rank.launch" in launcher


def test_json_args_and_rank_zero(group):
    out = group.call("echo", 1, "two", [3.5, None], flag=True, d={"k": "v"})
    assert out == [
        {"args": [1, "two", [3.5, None]], "kwargs": {"flag": True, "d": {"k": "v"}}, "rank": r}
        for r in (0, 1)
    ]
    assert group.call("count") < 1000  # rank 0's value only


def test_caller_errors_keep_the_group(group):
    with pytest.raises(AttributeError, match="not_registered"):
        group.call("not_registered")
    with pytest.raises(TypeError):
        group.call("echo", object())
    with pytest.raises(
        TypeError, match="out_url and dp_blocks are for DP_COMPUTE_PROTO methods; echo is ONE_TO_ALL"
    ):
        group.call("echo", out_url="/tmp/x.arrow")
    with pytest.raises(TypeError, match="data_url"):
        group.call("double")
    assert group.alive and group.call("echo", 1)[0]["args"] == [1]


def test_rank_output_is_streamed_with_rank_prefix(group, lines):
    group.call("say", "hello-from-ranks")
    for rank in (0, 1):
        for stream in ("stdout", "stderr"):
            assert lines.wait_for(f"[rank{rank}]:hello-from-ranks ({stream})"), lines.lines[-20:]


def test_many_calls_keep_the_group_warm(group, tmp_path):
    n_calls = 50
    t0 = time.perf_counter()
    for i in range(n_calls):
        assert group.call("echo", i)[1]["args"] == [i]
    per_call = (time.perf_counter() - t0) / n_calls * 1e3
    url = str(tmp_path / "in.arrow")
    make_proto(16).save(url)
    group.call("double", url, out_url=str(tmp_path / "warm.arrow"))  # warm the Arrow path
    t0 = time.perf_counter()
    for i in range(10):
        group.call("double", url, out_url=str(tmp_path / f"out{i}.arrow"))
    per_dp = (time.perf_counter() - t0) / 10 * 1e3
    print(f"\n[timing] ONE_TO_ALL call {per_call:.2f} ms; DP_COMPUTE_PROTO call (16 rows) {per_dp:.1f} ms")
    assert per_call < 50 and per_dp < 1000
    assert not [p for p in os.listdir(group.scratch) if p.startswith("call-")]  # chunks removed


# ---------------------------------------------------------------------- DP_COMPUTE_PROTO
@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_dp_compute_proto_equals_plain_loop(group, tmp_path, n):
    data = make_proto(n, seed=n)
    data.save(str(tmp_path / "in.arrow"))
    out_url = str(tmp_path / "out.arrow")
    assert group.call("double", str(tmp_path / "in.arrow"), out_url=out_url, offset=0.5) == out_url
    out = DataProto.load(out_url)
    expected = torch.stack([double_plus(row) + 0.5 for row in data.batch["x"]])
    assert len(out) == n
    assert torch.equal(out.batch["y"], expected)
    assert out.batch["id"].tolist() == list(range(n))
    assert list(out.non_tensor_batch["name"]) == [f"row{i}" for i in range(n)]
    assert out.meta_info == {"rank": 0, "rows": (n + 1) // 2}  # rank 0's meta_info

    rep_url = group.call("repeat3", str(tmp_path / "in.arrow"), out_url=str(tmp_path / "r.arrow"))
    rep = DataProto.load(rep_url)
    assert len(rep) == 3 * n
    assert torch.equal(rep.batch["x"], data.batch["x"].repeat_interleave(3, dim=0))
    assert list(rep.non_tensor_batch["name"]) == [f"row{i}" for i in range(n) for _ in range(3)]

    stats = group.call("stats", str(tmp_path / "in.arrow"))
    padded = list(range(n)) + list(range((-n) % 2))
    assert [s["rank"] for s in stats] == [0, 1]
    assert stats[0]["ids"] + stats[1]["ids"] == padded


def test_dp_layout_reported_by_ranks(group, tmp_path):
    """A worker that declares one dp replica of 2 ranks (TP-style): both get all rows, rank 0 outputs."""
    data = make_proto(5)
    data.save(str(tmp_path / "in.arrow"))
    try:
        assert group.call("set_layout", 1) == [{"dp_rank": 0, "dp_size": 1}] * 2
        stats = group.call("stats", str(tmp_path / "in.arrow"))
        assert stats[0]["ids"] == stats[1]["ids"] == [0, 1, 2, 3, 4, 0]  # padded to world size
        out = DataProto.load(
            group.call("double", str(tmp_path / "in.arrow"), out_url=str(tmp_path / "o.arrow"))
        )
        assert torch.equal(out.batch["y"], double_plus(data.batch["x"]))
    finally:
        group.call("set_layout", 2)
    assert group.call("stats", str(tmp_path / "in.arrow"))[1]["ids"] == [3, 4, 0]


def test_dp_metrics_merge_by_the_rules_the_method_declares(group, tmp_path):
    """``measure`` declares ``*_max`` as the largest over the ranks; its ``x_mean`` is undeclared
    (the mean over the ranks, of equal shares): both are the whole batch's."""
    data = make_proto(6, seed=3)
    data.save(str(tmp_path / "in.arrow"))
    out = DataProto.load(group.call("measure", str(tmp_path / "in.arrow"), out_url=str(tmp_path / "m.arrow")))
    x = data.batch["x"].double()
    assert out.batch["id"].tolist() == list(range(6))
    assert out.meta_info["metrics"] == pytest.approx({"x_max": x.max().item(), "x_mean": x.mean().item()})


def test_shutdown_runs_worker_hook_and_leaves_nothing(group, marker):
    """Last user of the module group: shut it down explicitly (the fixture's exit is then a no-op)."""
    pids, scratch = group.pids + [group.launcher_pid], group.scratch
    assert group.alive and os.path.isdir(scratch)
    t0 = time.monotonic()
    group.shutdown()
    print(f"\n[timing] shutdown {time.monotonic() - t0:.2f} s")
    assert [open(f"{marker}.{r}").read() for r in (0, 1)] == ["bye", "bye"]
    assert group.launcher.returncode == 0  # every rank exited 0, torchrun too
    assert not os.path.exists(scratch) and not group.alive
    assert_all_gone(pids)
    with pytest.raises(WorkerGroupDead, match="shut down"):
        group.call("echo")


# ---------------------------------------------------------------------- failures
def _failed_group(nprocs: int = 2, **kwargs) -> WorkerGroup:
    kwargs.setdefault("grace_s", 1.0)
    return WorkerGroup(TOY, nprocs=nprocs, config={}, log=Lines(), **kwargs).start()


def _check_dead(g: WorkerGroup) -> None:
    assert not g.alive
    with pytest.raises(WorkerGroupDead, match="start a new WorkerGroup"):
        g.call("echo", 1)
    assert_all_gone(g.pids + [g.launcher_pid])
    assert g.scratch is None
    g.shutdown()  # idempotent on a dead group


def test_rank_raises_while_others_wait_in_collective_or_sleep():
    """3 ranks: rank 1 raises, rank 0 waits in a gloo all_reduce, rank 2 sleeps (deaf to its link
    and outside any collective: only the driver's kill can stop it)."""
    g = _failed_group(grace_s=1.0, nprocs=3)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        g.call("fail", 1, in_collective=True, busy_rank=2, busy_s=60.0)
    dt = time.monotonic() - t0
    print(
        f"\n[timing] raise + other ranks stuck (all_reduce, sleep) -> RankFailure in {dt:.2f} s (grace 1.0 s)"
    )
    msg = str(info.value)
    assert info.value.rank == 1 and info.value.method == "fail"
    assert "rank 1 raised in 'fail'" in msg and "ValueError: toy failure on rank 1" in msg
    assert "Traceback (most recent call last)" in msg and "toy_workers.py" in msg
    assert "ranks [0, 2] still busy" in msg
    assert dt < 5
    _check_dead(g)


def test_injected_raise_without_collective_fails_fast():
    g = _failed_group(env={"PPOFLOW_FAULT": "rank_raise:echo:0"})
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="injected fault") as info:
        g.call("echo", 1)
    dt = time.monotonic() - t0
    print(f"\n[timing] raise (all ranks replied) -> RankFailure in {dt:.3f} s")
    assert info.value.rank == 0 and dt < 1.0  # no grace wait: every rank had replied
    _check_dead(g)


def test_sigkilled_rank_is_detected_during_a_call():
    g = _failed_group()
    victim = g.pids[1]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    timer.start()
    with pytest.raises(RankFailure) as info:
        g.call("sleep", 30.0)  # rank 0 ends up in a barrier waiting for the dead rank
    dt = time.monotonic() - killed_at[0]
    timer.join()
    print(f"\n[timing] SIGKILLed rank -> RankFailure in {dt:.2f} s")
    assert info.value.rank == 1 and "died during 'sleep'" in str(info.value)
    assert "last output lines" in str(info.value)
    assert dt < 5
    _check_dead(g)


def test_injected_rank_exit():
    g = _failed_group(nprocs=1, env={"PPOFLOW_FAULT": "task:x:before,rank_exit:echo:0:always"})
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        g.call("echo", 1)
    dt = time.monotonic() - t0
    print(f"\n[timing] rank os._exit(17) -> RankFailure in {dt:.2f} s")
    assert info.value.rank == 0 and "died during 'echo'" in str(info.value)
    assert "exitcode  : 17" in str(info.value)  # torchrun's report, from the output tail
    assert dt < 5
    _check_dead(g)


def test_rank_killed_between_calls():
    g = _failed_group(nprocs=1)
    os.kill(g.pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    while g.alive and time.monotonic() - t0 < 10:  # torchrun notices and exits
        time.sleep(0.05)
    with pytest.raises(RankFailure, match="torchrun exited") as info:
        g.call("echo", 1)
    print(f"\n[timing] idle rank SIGKILLed -> group not alive after {time.monotonic() - t0:.2f} s")
    assert "SIGKILL" in str(info.value) or "Signal 9" in str(info.value)
    _check_dead(g)


def test_rank_crash_before_connecting_fails_start():
    g = WorkerGroup(TOY, nprocs=1, config={}, env={"PPOFLOW_RANK_THREADS": "bogus"}, log=Lines())
    t0 = time.monotonic()
    with pytest.raises(GroupCannotStart, match="before all ranks connected") as info:
        g.start()
    print(f"\n[timing] rank crash at start -> GroupCannotStart in {time.monotonic() - t0:.2f} s")
    head = str(info.value).partition("\n--- ")[0]  # what a failure screen shows
    assert "rank 0 exited with status 1 while starting: ValueError: invalid literal for int()" in head
    assert "invalid literal for int()" in str(info.value).partition("\n--- ")[2]  # the rank's output
    assert is_permanent(info.value)  # the tasks do not retry it
    assert not g.alive and g.scratch is None
    assert_all_gone([g.launcher_pid])


def test_ranks_that_die_at_start_from_a_bad_environment_cannot_start():
    """A real misconfiguration: gloo told to use a network interface that does not exist. Every
    rank raises in ``init_process_group``; the start fails once torchrun reports it, long before
    the connect timeout, and says why in its first lines."""
    lines = Lines()
    g = WorkerGroup(
        TOY, nprocs=2, config={}, env={"GLOO_SOCKET_IFNAME": "nosuchif0"}, log=lines, start_timeout_s=120
    )
    t0 = time.monotonic()
    with pytest.raises(GroupCannotStart) as info:
        g.start()
    took = time.monotonic() - t0
    print(f"\n[timing] bad GLOO_SOCKET_IFNAME -> GroupCannotStart in {took:.2f} s")
    head, _, tail = str(info.value).partition("\n--- last output lines of the ranks/torchrun ---\n")
    assert head.startswith("torchrun exited (status 1) before all ranks connected (0/2 had)")
    assert "while starting: RuntimeError: " in head and "Unable to find address for: nosuchif0" in head
    assert "fails the same way" in head
    assert tail == g.output_tail() and "Unable to find address for: nosuchif0" in tail
    report = tail.splitlines()[tail.splitlines().index("Root Cause (first observed failure):") :]
    first = next(line for line in report if line.strip().startswith("rank "))  # "rank : 1 (local_rank: 1)"
    assert f"\nrank {first.split(':')[1].split()[0]} exited with status 1 while starting: " in head
    assert tail.splitlines()[-1] == lines.lines[-1]  # the last lines the ranks and torchrun printed
    assert took < 120 and is_permanent(info.value)
    _check_dead(g)


@pytest.mark.parametrize(
    "worker, error",
    [
        ("no_such_package.workers:Worker", "ModuleNotFoundError: No module named 'no_such_package'"),
        (
            "tests.support.toy_workers:NoSuchWorker",
            "AttributeError: module 'tests.support.toy_workers' has no attribute 'NoSuchWorker'",
        ),
    ],
)
def test_a_worker_class_that_does_not_import_cannot_start(worker, error):
    g = WorkerGroup(worker, nprocs=1, config={}, grace_s=1.0, log=Lines())
    with pytest.raises(GroupCannotStart) as info:
        g.start()
    head = str(info.value).partition("\n--- ")[0]
    assert head.startswith(f"rank 0 raised in '__init__': {error}")
    assert "does not import: a new start fails the same way" in head
    assert info.value.method == "__init__" and is_permanent(info.value)
    _check_dead(g)


def test_ranks_that_do_not_connect_in_time_fail_the_start_and_may_be_retried():
    """Half a second is less than a rank's imports take: no rank connects in time. A connect
    timeout can be a busy machine: the tasks may retry it (it is no GroupCannotStart)."""
    g = WorkerGroup(TOY, nprocs=1, config={}, log=Lines(), start_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"only 0/1 ranks connected within 0.5 s") as info:
        g.start()
    assert time.monotonic() - t0 < 5
    assert not isinstance(info.value, GroupCannotStart) and not is_permanent(info.value)
    assert_all_gone([g.launcher_pid])


def test_worker_constructor_failure_fails_start():
    g = WorkerGroup(TOY, nprocs=1, config={"fail_in_init_on_rank": 0}, grace_s=1.0, log=Lines())
    with pytest.raises(RankFailure, match="init failure requested for rank 0") as info:
        g.start()
    assert info.value.method == "__init__"
    _check_dead(g)


DRIVER = """
import json, os, sys
sys.path.insert(0, {root!r})
from ppoflow.infra.remote.driver.group import WorkerGroup
g = WorkerGroup("tests.support.toy_workers:ToyWorker", nprocs=2, config={{}}).start()
print(json.dumps(g.pids + [g.launcher_pid]), flush=True)
os._exit(3)  # die without shutdown, finalizers or atexit
"""


def test_ranks_exit_when_the_driver_dies():
    out = subprocess.run(
        [sys.executable, "-c", DRIVER.format(root=ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 3, out.stderr[-2000:]
    t0 = time.monotonic()
    assert_all_gone(json.loads(out.stdout.strip().splitlines()[-1]), timeout=10)
    print(f"\n[timing] ranks gone {time.monotonic() - t0:.2f} s after the driver died")
