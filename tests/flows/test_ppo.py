"""The `ppo` flow under a real (temporary) Prefect API, on 2 CPU ranks with vLLM and tiny models,
and the forms its ``config`` parameter takes.

``base_run`` (conftest) is a new experiment run for 2 iterations in one flow run; the other flow
tests (tests/scenarios/) compare against it.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.ipc
import pytest

from ppoflow.flows.ppo import resolve_config
from ppoflow.infra.checkpoint.sharded import is_complete
from ppoflow.infra.config import ConfigError, dump_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.tasks.graph import steps
from tests.support.experiments import copy_experiment

ARROW_FILES = ("prompts", "rollout", "ref_log_prob", "values", "rm_scores", "advantages")
REQUIRED_METRICS = (
    "perf/throughput",
    "response_length/mean",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "critic/values/mean",
    "critic/vf_explained_var",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "critic/vf_loss",
    "critic/grad_norm",
    "actor/reward_kl_penalty",
    "timing_s/iteration",
    "weight_sync_s",
    *(
        f"timing_s/{t}"
        for t in (
            "generate",
            "ref_log_prob",
            "values",
            "rm_score",
            "advantage",
            "update_actor",
            "update_critic",
            "commit",
        )
    ),
)


# ----------------------------------------------------------------------------- helpers


def artifacts(state) -> dict:
    """The artifact types of a flow run (and its tasks), by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    out: dict = {}
    for a in sorted(found, key=lambda a: a.created):
        out.setdefault(a.key, []).append(a.type)
    return out


def read_arrow(url: str) -> pa.Table:
    """Read a DataProto file with plain pyarrow (no ppoflow code)."""
    with open(url, "rb") as f:
        return pyarrow.ipc.open_file(f).read_all()


# ----------------------------------------------------------------------------- tests


def test_the_config_parameter_is_a_config_a_yaml_path_or_a_mapping(tmp_path):
    """What a caller, a YAML file or a deployment's JSON parameter gives is the same config; anything
    else, or a mapping that is not a config, is one ConfigError naming the parameter."""
    data = {"model": {"path": "m"}, "data": {"train_files": ["x.parquet"]}, "seed": 3}
    cfg = resolve_config(data)
    assert (cfg.model.path, cfg.data.train_files, cfg.seed) == ("m", ["x.parquet"], 3)
    assert resolve_config(cfg) is cfg
    path = tmp_path / "experiment.yaml"
    path.write_text(dump_config(cfg))
    assert resolve_config(str(path)) == cfg
    with pytest.raises(ConfigError, match="flow parameter 'config'"):
        resolve_config({**data, "seed": "not a number"})
    with pytest.raises(
        ConfigError, match="config must be an ExperimentConfig, a YAML path/URL or a dict; got int"
    ):
        resolve_config(3)


@pytest.mark.slow
def test_two_iterations_commit_manifests_files_and_metrics(base_run):
    url = base_run["url"]
    paths = ExperimentPaths(url)
    manifest = read_manifest(paths)
    assert manifest.iteration == 2 and base_run["result"]["iteration"] == 2
    chain = [storage.read_json(paths.file(n, "manifest.json")) for n in (0, 1, 2)]
    assert [m["iteration"] for m in chain] == [0, 1, 2]
    assert [m["data_cursor"] for m in chain] == [
        {"epoch": 0, "offset": 0},
        {"epoch": 0, "offset": 4},
        {"epoch": 0, "offset": 8},
    ]
    assert chain[0]["kl_coef"] == 0.05 and chain[2]["kl_coef"] != 0.05  # adaptive, persisted
    assert [t["iteration"] for t in manifest.trend] == [1, 2]
    assert not os.path.exists(paths.lock)  # released
    assert os.path.exists(paths.url(manifest.config_history[0]["config"]))
    for n in (0, 1, 2):
        for role in ("actor", "critic"):
            assert is_complete(paths.checkpoint(role, n))
    for n in (1, 2):
        tables = {name: read_arrow(paths.file(n, f"{name}.arrow")) for name in ARROW_FILES}
        assert tables["prompts"].num_rows == 4
        assert all(t.num_rows == 8 for name, t in tables.items() if name != "prompts")
        assert {"responses", "response_mask", "old_log_probs", "uid"} <= set(tables["rollout"].column_names)
        # vLLM's own log-probs (rollout.calculate_log_probs, on by default): the mismatch is measured
        assert "rollout_log_probs" in tables["rollout"].column_names
        assert {
            "token_level_scores",
            "token_level_rewards",
            "advantages",
            "returns",
            "values",
            "ref_log_prob",
            "rm_scores",
        } <= set(tables["advantages"].column_names)
        # every step of the table that runs for this config left its receipt, with the output the
        # table names (the asynchronous rows run only with asynchronous training)
        for spec in steps(base_run["cfg"]):
            if spec.name in ("evaluate", "commit"):
                continue  # evaluate runs without val files never; commit publishes the manifest
            receipt = storage.read_json(paths.receipt(n, spec.name))
            assert spec.output is None or spec.output in receipt["outputs"], (spec.name, receipt["outputs"])
        metrics = storage.read_json(paths.file(n, "metrics.json"))
        missing = [k for k in REQUIRED_METRICS if k not in metrics]
        assert not missing, f"metrics.json of iteration {n} lacks {missing}"
        # float32 vLLM against the float32 FSDP actor on the same weights: ~1e-6 per token
        assert 1.0 <= metrics["mismatch/token_mult_prob_error"] < 1.0001
        assert metrics["mismatch/abs_log_ratio_max"] < 1e-3 and metrics["mismatch/tokens"] > 0
        # the commit's wait for the background checkpoint writes is on the critical path, not
        # counted as orchestration overhead
        assert metrics["timing_s/commit"] >= metrics["timing_s/commit_wait_checkpoints"] >= 0
    assert os.path.getsize(os.path.join(url, "plots", "metrics.png")) > 1000
    kinds = artifacts(base_run["state"])
    assert kinds["exp-metrics"] == ["table", "table"] and kinds["exp-summary"] == ["markdown"] * 2
    assert kinds["exp-plot"] == ["markdown"] and kinds[None].count("progress") == 2
    m1 = storage.read_json(paths.file(1, "metrics.json"))
    print(
        f"\nbase run: {base_run['wall_s']:.1f} s for init + 2 iterations; iteration wall "
        f"{m1['timing_s/iteration']:.2f} s / critical path {m1['timing_s/critical_path']:.2f} s"
        f" / Prefect+flow overhead {m1['timing_s/overhead']:.3f} s (iteration 1); iteration 2: "
        f"{storage.read_json(paths.file(2, 'metrics.json'))['timing_s/overhead']:.3f} s"
    )


@pytest.mark.slow
def test_identity_change_is_refused_and_nothing_changes(base_run, flow_config, tmp_path):
    from ppoflow.flows.ppo import ppo

    url = copy_experiment(base_run["url"], str(tmp_path), "exp")
    before = storage.read_bytes(os.path.join(url, "manifest.json"))
    cfg = flow_config(str(tmp_path), "exp", **{"model.path": base_run["cfg"].model.path + "-other"})
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    msg = str(state.result(raise_on_failure=False))
    assert "model.path" in msg and "storage.experiment" in msg
    assert storage.read_bytes(os.path.join(url, "manifest.json")) == before
    assert not os.path.exists(os.path.join(url, "lock.json"))


@pytest.mark.slow
def test_whole_flow_on_s3(prefect_harness, flow_config, s3_server):
    """storage.root on S3 (moto): experiment lock, data, checkpoints and manifest all there.
    A lighter config (GRPO: no critic, no reward model) keeps it to one worker group."""
    from ppoflow.flows.ppo import ppo

    cfg = flow_config(
        f"{s3_server['url']}/flows",
        "s3exp",
        **{
            "critic.enable": False,
            "algorithm.adv_estimator": "grpo",
            "algorithm.use_kl_in_reward": False,
            "reward.reward_model.enable": False,
        },
    )
    result = ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert result["iteration"] == 1 and read_manifest(paths).iteration == 1
    for name in ("prompts", "rollout", "advantages"):
        fs, path = storage.url_to_fs(paths.file(1, f"{name}.arrow"))
        with fs.open(path, "rb") as f:
            table = pyarrow.ipc.open_file(pa.BufferReader(f.read())).read_all()
        assert table.num_rows == (4 if name == "prompts" else 8)
    assert is_complete(paths.checkpoint("actor", 0)) and is_complete(paths.checkpoint("actor", 1))
    assert read_manifest(paths).critic_checkpoint is None
    metrics = storage.read_json(paths.file(1, "metrics.json"))
    assert {"critic/advantages/mean", "actor/pg_loss", "timing_s/generate", "perf/throughput"} <= set(metrics)
    assert not storage.exists(paths.lock)
