"""The ``ppo`` flow with ``MLFLOW_TRACKING_URI`` set: one real iteration lands in a real
``mlflow server`` as the commit wrote it (metrics.json at step 1, the config, the plot); with
``tracking.wandb`` offline beside it, in the experiment's W&B run too (the same numbers at step 1,
the same flattened config, the iteration's table of samples)."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("mlflow", reason="the MLflow client: pip install 'ppoflow[mlflow]'")

from mlflow.tracking import MlflowClient

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.experiment.metrics import finite_scalars
from ppoflow.infra.experiment.tracking import RUN_FILE, flat_config
from tests.support.wandb_runs import offline_runs, use_local_wandb_dirs

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_a_tracked_flow_run(prefect_harness, flow_config, mlflow_server, tmp_path, monkeypatch):
    from ppoflow.flows.ppo import ppo

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    use_local_wandb_dirs(monkeypatch, tmp_path)
    cfg = flow_config(
        str(tmp_path), "tracked", **{"resources.nprocs": 1, "tracking.wandb": {"mode": "offline"}}
    )
    ppo(cfg, iterations=1)

    paths = ExperimentPaths(cfg.storage.experiment_url)
    committed = storage.read_json(paths.file(1, "metrics.json"))
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = json.load(open(os.path.join(paths.root, RUN_FILE)))["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    numbers = {
        k: float(v)
        for k, v in committed.items()
        if k not in ("iteration", "timestamp") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    numbers = {k: v for k, v in numbers.items() if math.isfinite(v)}
    assert set(run.data.metrics) == set(numbers)  # the tiny config's names need no rewriting
    for key, value in numbers.items():
        [point] = client.get_metric_history(run_id, key)
        assert (point.step, point.value) == (1, value), key
    assert run.data.params["seed"] == "7" and run.data.params["actor.optim.lr"] == "0.001"
    assert run.data.params["storage.experiment"] == "tracked"
    got = client.download_artifacts(run_id, "plots/metrics.png", str(tmp_path / "dl"))
    assert open(got, "rb").read() == storage.read_bytes(os.path.join(paths.root, "plots", "metrics.png"))

    [wandb_run] = offline_runs(os.path.join(paths.root, "wandb"))  # both trackers at once
    [(step, item)] = wandb_run.history
    assert step == 1 and item["iteration"] == 1
    assert {k: v for k, v in finite_scalars(item).items() if not k.startswith("samples.")} == numbers
    assert wandb_run.table(1, "samples") == storage.read_json(paths.file(1, "samples.json"))
    assert wandb_run.config == flat_config(cfg.model_dump(mode="json"))  # numbers as numbers
    assert set(wandb_run.config) == set(run.data.params)  # MLflow's keys
