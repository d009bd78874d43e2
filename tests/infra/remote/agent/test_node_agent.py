"""The node agent's node number, from the launcher that started it."""

from __future__ import annotations

from ppoflow.infra.remote.agent.node_agent import node_rank_from_env


def test_node_rank_from_slurm_kubernetes_or_ppoflow():
    assert node_rank_from_env({"SLURM_NODEID": "3"}) == 3
    assert node_rank_from_env({"JOB_COMPLETION_INDEX": "1"}) == 1
    assert node_rank_from_env({"PPOFLOW_NODE_RANK": "0", "SLURM_NODEID": "3"}) == 0
    assert node_rank_from_env({}) is None
