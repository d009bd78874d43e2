"""A mixture-of-experts policy (the model matrix's tiny Qwen3-MoE: 4 experts, top-2) in the real
flow (2 CPU ranks, FSDP only: no expert parallelism): its router metrics land in every committed
iteration's metrics, and a run resumed between snapshots, whose state is rebuilt by replaying the
stored update through the same routers, commits bit for bit what the uninterrupted run committed
(metrics, the snapshot); the export of the state between snapshots is the uninterrupted run's, in
the checkpoint's per-expert layout.

The seams of the engine (expert weights pushed into vLLM's fused-expert layout, log-probs equal) are
tests/scenarios/test_model_matrix.py's; here transformers generates on the actor's own module
(``rollout.engine: hf``: one group start without vLLM per flow run, three flow runs).
"""

from __future__ import annotations

import math

import pytest
import torch

from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.configs import LIGHT_HF
from tests.support.experiments import assert_same_state, comparable_metrics

pytestmark = pytest.mark.slow

MOE = ("actor/moe/aux_loss", "actor/moe/load_max", "actor/moe/load_min", "actor/moe/load_entropy")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from ppoflow.demo.tiny_models import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("moe") / "qwen3-moe"), arch="qwen3_moe")


def test_moe_router_metrics_and_a_resume_between_snapshots_commit_the_same(
    prefect_harness, flow_config, moe_model, tmp_path, capsys
):
    from safetensors.torch import load_file

    from ppoflow.cli.main import main
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict

    over = {**LIGHT_HF, "model.path": moe_model, "checkpoint.snapshot_at_end": False}
    reference = flow_config(str(tmp_path / "every"), "every", **over)  # every state written
    assert ppo(reference, iterations=2)["iteration"] == 2
    resumed = flow_config(str(tmp_path / "snap"), "snap", **over, **{"checkpoint.snapshot_every": 2})
    assert ppo(resumed, iterations=1)["iteration"] == 1  # state 1 is not written: snapshot 0 + replay
    paths, ref = ExperimentPaths.of(resumed), ExperimentPaths.of(reference)
    assert not is_complete(paths.checkpoint("actor", 1))
    assert [e["iteration"] for e in read_manifest(paths).replay["actor"]] == [1]
    assert ppo(resumed, iterations=1)["iteration"] == 2  # a new run: rebuilds state 1, commits 2

    for n in (1, 2):
        metrics = storage.read_json(paths.file(n, "metrics.json"))
        assert all(math.isfinite(metrics[key]) for key in MOE), (n, metrics)
        assert 0 < metrics["actor/moe/load_min"] <= 0.25 <= metrics["actor/moe/load_max"] < 1
        assert comparable_metrics(paths.root, n) == comparable_metrics(ref.root, n), n
    assert storage.read_json(paths.file(2, "metrics.json"))["replay/actor_updates"] == 1
    assert_same_state(ref.checkpoint("actor", 2), paths.checkpoint("actor", 2))  # the snapshot

    out = tmp_path / "hf-1"  # between snapshots: rebuilt by replay, exported in the checkpoint layout
    assert main(["export-hf", paths.root, str(out), "--iteration", "1"]) == 0
    assert "rebuilt the actor's state of iteration 1" in capsys.readouterr().out
    exported, want = (
        load_file(str(out / "model.safetensors")),
        load_full_state_dict(ref.checkpoint("actor", 1)),
    )
    fused = want.pop("model.layers.0.mlp.experts.down_proj")
    per_expert = [exported[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(4)]
    assert torch.equal(torch.stack(per_expert), fused)
    assert all(torch.equal(exported[k], v) for k, v in want.items() if k in exported)
