"""The torchrun command lines and the environment of the ranks."""

from __future__ import annotations

import os

from ppoflow.infra.remote.procs import rank_env, rendezvous_torchrun_command, torchrun_command
from ppoflow.infra.remote.rank import launch

KEY = "k" * 40


# ---------------------------------------------------------------------- the agent's side
def test_the_torchrun_line_of_a_node_carries_no_secret():
    cmd = rendezvous_torchrun_command(2, 8, "driver:29400", "ab12-actor-1", 300, "10.0.0.2", "/tmp/logs")
    assert cmd[1:3] == ["-m", "ppoflow.infra.remote.rank.launch"]  # torchrun, through the launcher
    for arg in (
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=driver:29400",
        "--rdzv-id=ab12-actor-1",
        "--rdzv-conf=is_host=false,join_timeout=300",
        "--local-addr=10.0.0.2",
        "--max-restarts=0",
    ):
        assert arg in cmd
    assert not any(KEY in a or "AUTHKEY" in a or "KEY" in a for a in cmd)


# ---------------------------------------------------------------------- the launcher
def test_cpu_ranks_are_forked_from_the_launcher_and_cuda_ranks_spawned():
    flags = torchrun_command(2, "/tmp/logs")[3:]
    assert "--nproc-per-node=2" in flags and "--standalone" in flags
    forked = launch.torchrun_argv(flags, {"PPOFLOW_DEVICE": "cpu"})
    assert forked[: len(flags)] == flags and forked[len(flags) :][:3] == [
        "--start-method",
        "fork",
        "--run-path",
    ]
    rank_main = forked[-1]
    assert os.path.basename(rank_main) == "__main__.py" and os.path.dirname(rank_main) == os.path.dirname(
        launch.__file__
    )
    with open(rank_main) as f:
        assert "from ppoflow.infra.remote.rank.entry import main" in f.read()
    assert launch.torchrun_argv(flags, {"PPOFLOW_DEVICE": "cuda"}) == [
        *flags,
        "-m",
        "ppoflow.infra.remote.rank.entry",
    ]


def test_cpu_ranks_openmp_threads_sleep_while_they_wait_unless_told_otherwise():
    """Spinning threads of one group hold the cores another group's ranks need (the demo at one rank
    a group on 2 cores: 8 iterations in 248 s with libgomp's own policy, 46 s sleeping;
    benchmarks/cpu_wait_policy.py)."""
    cpu = rank_env({}, ("127.0.0.1", 1), b"k", "w:W", "cpu", local_world=2)
    assert cpu["OMP_WAIT_POLICY"] == "PASSIVE"
    assert (
        rank_env({"OMP_WAIT_POLICY": "ACTIVE"}, ("h", 1), b"k", "w:W", "cpu", 2)["OMP_WAIT_POLICY"]
        == "ACTIVE"
    )
    assert "OMP_WAIT_POLICY" not in rank_env({}, ("h", 1), b"k", "w:W", "cuda", 2)  # GPU ranks as they were
