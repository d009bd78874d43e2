"""The torchrun command lines of the ranks."""

from __future__ import annotations

from ppoflow.infra.remote.procs import rendezvous_torchrun_command

KEY = "k" * 40


# ---------------------------------------------------------------------- the agent's side
def test_the_torchrun_line_of_a_node_carries_no_secret():
    cmd = rendezvous_torchrun_command(2, 8, "driver:29400", "ab12-actor-1", 300, "10.0.0.2", "/tmp/logs")
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and cmd[-2:] == [
        "-m",
        "ppoflow.infra.remote.rank.entry",
    ]
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
