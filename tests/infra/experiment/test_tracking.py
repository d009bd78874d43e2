"""MLflow tracking against a real ``mlflow server`` (and a ``file://`` store): what a commit, the
plot and a promotion send is what MlflowClient reads back; a later flow run continues the run;
a server that goes away costs one warning and never an exception."""

from __future__ import annotations

import json
import math
import os
import sys
import uuid

import pytest

pytest.importorskip("mlflow", reason="the MLflow client: pip install 'ppoflow[mlflow]'")

from mlflow.tracking import MlflowClient

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.experiment.promotion import publish_promotion
from ppoflow.infra.experiment.tracking import RUN_FILE, MlflowTracker
from tests.support.mlflow_server import start_server

pytestmark = pytest.mark.integration

CONFIG = {"actor": {"optim": {"lr": 1e-6}}, "data": {"files": ["a.parquet", "b.parquet"]}, "seed": 7}
# what a commit's metrics.json holds (a bool, a NaN and the bookkeeping keys are not metrics)
ITERATIONS = {
    1: {"iteration": 1, "timestamp": 1_700_000_000.5, "critic/score/mean": 0.5, "val/gsm/pass@4": 0.25},
    2: {"iteration": 2, "timestamp": 1_700_000_060.0, "critic/score/mean": 0.75, "actor/kl": float("nan")},
}


def _experiment(tmp_path) -> tuple[str, str]:
    name = f"exp-{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    root.mkdir()
    return str(root), name


def _eval_dir(root: str, n: int) -> str:
    d = os.path.join(root, "iterations", f"{n:06d}", "eval", "val")
    os.makedirs(d)
    with open(os.path.join(d, "metrics.json"), "w") as f:
        json.dump({"val/gsm/pass@4": 0.25}, f)
    with open(os.path.join(d, "generations.arrow"), "wb") as f:
        f.write(b"ARROW1-not-parsed-here")
    return d


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_metrics_params_artifacts_and_the_same_run_across_flow_runs(mlflow_server, tmp_path):
    root, name = _experiment(tmp_path)
    warnings: list[str] = []
    tracker = MlflowTracker.of(root, name, warnings.append, uri=mlflow_server.uri)
    assert tracker is not None
    tracker.start(CONFIG)
    tracker.log_iteration(1, ITERATIONS[1], _eval_dir(root, 1))
    tracker.log_iteration(2, ITERATIONS[2])
    plot = os.path.join(root, "plots", "metrics.png")
    os.makedirs(os.path.dirname(plot))
    with open(plot, "wb") as f:
        f.write(b"\x89PNG-bytes")
    tracker.log_file(plot, "plots")
    tracker.finish()
    assert warnings == []

    client = MlflowClient(tracking_uri=mlflow_server.uri)
    run_id = json.load(open(os.path.join(root, RUN_FILE)))["run_id"]
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == name
    assert run.info.status == "FINISHED"
    assert run.data.params == {
        "actor.optim.lr": "1e-06",
        "data.files": "['a.parquet', 'b.parquet']",
        "seed": "7",
    }
    assert _history(client, run_id, "critic/score/mean") == [(1, 0.5), (2, 0.75)]
    assert _history(client, run_id, "val/gsm/pass_at_4") == [(1, 0.25)]
    assert [m.timestamp for m in client.get_metric_history(run_id, "val/gsm/pass_at_4")] == [
        1_700_000_000_500
    ]
    assert set(run.data.metrics) == {"critic/score/mean", "val/gsm/pass_at_4"}  # no NaN, no bookkeeping
    files = {a.path for a in client.list_artifacts(run_id, "eval/000001/val")}
    assert files == {"eval/000001/val/metrics.json", "eval/000001/val/generations.arrow"}
    got = client.download_artifacts(run_id, "eval/000001/val/generations.arrow", str(tmp_path / "dl"))
    assert open(got, "rb").read() == b"ARROW1-not-parsed-here"
    got = client.download_artifacts(run_id, "plots/metrics.png", str(tmp_path / "dl"))
    assert open(got, "rb").read() == b"\x89PNG-bytes"
    got = client.download_artifacts(run_id, "config/config.json", str(tmp_path / "dl"))
    assert json.load(open(got)) == CONFIG

    # the next flow run of the experiment: the same MLflow run, its steps after the first ones
    changed = {**CONFIG, "seed": 8, "rollout": {"n": 4}}
    again = MlflowTracker.of(root, name, warnings.append, uri=mlflow_server.uri)
    assert again is not None
    again.start(changed)
    assert client.get_run(run_id).info.status == "RUNNING"
    again.log_iteration(3, {"iteration": 3, "critic/score/mean": 1.0})
    again.finish()
    assert warnings == []
    assert again.run_id == run_id
    assert len(client.search_runs([run.info.experiment_id])) == 1
    run = client.get_run(run_id)
    assert _history(client, run_id, "critic/score/mean") == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert run.data.params["seed"] == "7" and run.data.params["rollout.n"] == "4"
    assert run.data.tags["config.seed"] == "8"


def test_each_promotion_is_a_registered_model_version(mlflow_server, tmp_path, monkeypatch):
    root, name = _experiment(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    paths = ExperimentPaths(root)
    for n, score in ((2, 0.3), (5, 0.4)):
        publish_promotion(
            paths,
            n,
            lambda out, n=n: save_tiny_model(out, seed=n),
            metric="val/score",
            metrics={"val/score": score, "val/gsm/pass@4": score / 2},
            rule={"rule": "gain"},
        )

    client = MlflowClient(tracking_uri=mlflow_server.uri, registry_uri=mlflow_server.uri)
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    assert [v.version for v in versions] == ["1", "2"]
    run_id = json.load(open(os.path.join(root, RUN_FILE)))["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    for v, n, score in zip(versions, (2, 5), (0.3, 0.4)):
        assert v.run_id == run_id
        assert v.tags["iteration"] == str(n) and v.tags["metric"] == "val/score"
        assert math.isclose(float(v.tags["value"]), score)
        assert math.isclose(float(v.tags["metric.val/gsm/pass_at_4"]), score / 2)
        # the version's files are the promoted HF directory, byte for byte
        got = client.download_artifacts(run_id, f"promotions/{n:06d}", str(tmp_path / f"dl-{n}"))
        here = os.path.join(root, "promotions", "models", f"{n:06d}")
        assert sorted(os.listdir(got)) == sorted(os.listdir(here))
        for f in os.listdir(here):
            assert open(os.path.join(got, f), "rb").read() == open(os.path.join(here, f), "rb").read()


def test_a_server_that_goes_away_costs_one_warning_and_no_exception(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    server = start_server(tmp_path / "server")
    try:
        root, name = _experiment(tmp_path)
        warnings: list[str] = []
        tracker = MlflowTracker.of(root, name, warnings.append, uri=server.uri)
        assert tracker is not None
        tracker.start(CONFIG)
        tracker.log_iteration(1, ITERATIONS[1])
        assert warnings == []
        server.stop()
        tracker.log_iteration(2, ITERATIONS[2])
        tracker.log_iteration(3, {"iteration": 3, "critic/score/mean": 1.0})
        tracker.log_file(__file__, "plots")
        assert tracker.register_promotion({"iteration": 3, "metrics": {}}, str(tmp_path)) is None
        tracker.finish()
        assert len(warnings) == 1, warnings
        assert server.uri in warnings[0] and "iteration 2" in warnings[0]
    finally:
        server.stop()


def test_a_file_store_needs_no_server(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    root, name = _experiment(tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    warnings: list[str] = []
    tracker = MlflowTracker.of(root, name, warnings.append, uri=uri)
    assert tracker is not None
    tracker.start(CONFIG)
    tracker.log_iteration(1, ITERATIONS[1])
    tracker.log_iteration(2, ITERATIONS[2])
    model = save_tiny_model(str(tmp_path / "model"), seed=1)
    version = tracker.register_promotion({"iteration": 2, "metric": "val/score", "value": 0.5}, model)
    tracker.finish()
    assert warnings == []
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run_id = storage.read_json(os.path.join(root, RUN_FILE))["run_id"]
    assert _history(client, run_id, "critic/score/mean") == [(1, 0.5), (2, 0.75)]
    assert client.get_run(run_id).data.params["seed"] == "7"
    assert client.get_model_version(name, version).tags["iteration"] == "2"
    assert os.listdir(tmp_path / "cwd") == []  # nothing of MLflow's own defaults in the cwd


def test_off_without_the_variable_and_without_the_client(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    warnings: list[str] = []
    assert MlflowTracker.of(str(tmp_path), "exp", warnings.append) is None and warnings == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # as if mlflow-skinny were not installed
    assert MlflowTracker.of(str(tmp_path), "exp", warnings.append) is None
    assert len(warnings) == 1 and "pip install 'ppoflow[mlflow]'" in warnings[0]
