"""Training data that grows, through the ``ppo`` flow: a directory of parquet files.

The first run trains on the two files there; a third file arrives and the next run's batch is that
file's rows; a rerun of that iteration (on a copy rolled back to iteration 1, with a fourth file
arrived meanwhile) reads the same rows and commits the same iteration bit for bit; a file that was
read and then changed fails the next run, naming the file. Between them, ``ppoflow promote`` by
hand: two promotions and a rollback. The rollout engine is transformers' (``rollout.engine: hf``):
nothing here is about the engine, and its groups start in half vLLM's time.

The experiment is tracked by W&B offline (``tracking.wandb``): its two flow runs are one W&B run
whose history holds each iteration's metrics.json at its step, with its table of samples; the
rerun of iteration 2 on the rolled-back copy lands at step 3, after the 2 already logged.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.experiment.metrics import finite_scalars
from ppoflow.infra.experiment.promotion import promoted_url
from tests.support.configs import LIGHT_HF
from tests.support.experiments import assert_same_commit, copy_experiment
from tests.support.wandb_runs import offline_runs, use_local_wandb_dirs

pytestmark = pytest.mark.slow


def _write(path, start: int, n: int = 4) -> list[str]:
    """``n`` GSM8K-like rows numbered from ``start``; returns their questions."""
    questions = [f"{i}+{i % 5}=" for i in range(start, start + n)]
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": q}],
            "reward_model": {"ground_truth": str(i + i % 5), "style": "rule"},
        }
        for i, q in zip(range(start, start + n), questions)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return questions


def _questions(paths: ExperimentPaths, n: int) -> list[str]:
    prompts = DataProto.load(paths.file(n, "prompts.arrow")).non_tensor_batch["raw_prompt"]
    return [p[0]["content"] for p in prompts]


def _tracked(paths: ExperimentPaths, steps: list[tuple[int, int]], since: int = 1) -> None:
    """The experiment's W&B offline runs: one run, the one ``wandb.json`` names; at each (step,
    iteration) from step ``since`` on, the iteration's metrics.json (its finite numbers) and
    samples.json (as the ``samples`` table)."""
    runs = offline_runs(storage.join(paths.root, "wandb"))
    assert {r.run_id for r in runs} == {storage.read_json(storage.join(paths.root, "wandb.json"))["id"]}
    logged = [(step, item["iteration"], run) for run in runs for step, item in run.history]
    assert [(step, n) for step, n, _ in logged] == steps
    for step, n, run in logged[since - 1 :]:
        item = dict(run.history)[step]
        numbers = {k: v for k, v in finite_scalars(item).items() if not k.startswith("samples.")}
        assert numbers == finite_scalars(storage.read_json(paths.file(n, "metrics.json")))
        assert run.table(step, "samples") == storage.read_json(paths.file(n, "samples.json"))
    assert runs[0].config["storage.experiment"] == "growing" and runs[0].config["actor.optim.lr"] == 1e-3


def test_new_files_are_trained_on_next_and_a_rerun_reads_the_same_rows(
    prefect_harness, flow_config, tmp_path, capsys, monkeypatch
):
    from ppoflow.cli.main import main
    from ppoflow.flows.ppo import ppo

    use_local_wandb_dirs(monkeypatch, tmp_path)
    drop = tmp_path / "drop"
    drop.mkdir()
    first = _write(drop / "2026-01-01.parquet", 0) + _write(drop / "2026-01-02.parquet", 10)
    tracked = {"data.train_files": [str(drop)], "tracking.wandb": {"mode": "offline"}}
    cfg = flow_config(str(tmp_path / "runs"), "growing", **LIGHT_HF, **tracked)
    paths = ExperimentPaths.of(cfg)

    ppo(cfg, iterations=1)
    assert set(_questions(paths, 1)) <= set(first)
    manifest = read_manifest(paths)
    assert [(r["url"].rsplit("/", 1)[-1], r["rows"]) for r in manifest.data_files] == [
        ("2026-01-01.parquet", 4),
        ("2026-01-02.parquet", 4),
    ]

    third = _write(drop / "2026-01-03.parquet", 20)
    ppo(cfg, iterations=1)
    assert sorted(_questions(paths, 2)) == sorted(third)  # the new rows, first
    manifest = read_manifest(paths)
    assert [r["joined"] for r in manifest.data_files] == [1, 1, 2]
    assert manifest.data_cursor == {"epoch": 1, "offset": 4, "fresh": 8}
    _tracked(paths, [(1, 1), (2, 2)])  # two flow runs, one W&B run

    # a rerun of iteration 2 after a fourth file arrived: same files, same rows, same commit
    _write(drop / "2026-01-04.parquet", 30)
    assert main(["status", paths.root]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\ndata read +3 file\(s\), 12 rows \(the last joined at iteration 2\)\n", out)
    assert re.search(rf"\ndata new +{drop}/2026-01-04.parquet \(joins at the next run\)\n", out)
    url = copy_experiment(paths.root, str(tmp_path / "rerun"), "growing", at=1)
    rerun = flow_config(str(tmp_path / "rerun"), "growing", **LIGHT_HF, **tracked)
    ppo(rerun, iterations=1)
    # the copy's W&B run is the original's: iteration 2 again lands after the 2 steps logged
    _tracked(ExperimentPaths(url), [(1, 1), (2, 2), (3, 2)], since=3)
    assert _questions(ExperimentPaths(url), 2) == _questions(paths, 2)
    assert read_manifest(ExperimentPaths(url)).data_files == manifest.data_files
    assert_same_commit(paths.root, url, 2, roles=("actor",))

    # the human side of promotion: promote 1, then 2, roll back to 1; status says which
    for argv in (["--iteration", "1"], ["--iteration", "2"], ["--rollback"]):
        assert main(["promote", paths.root, *argv]) == 0
    assert "rolled back to" in capsys.readouterr().out
    promoted = AutoModelForCausalLM.from_pretrained(promoted_url(paths)).state_dict()
    trained = load_full_state_dict(paths.checkpoint("actor", 1))
    assert promoted.keys() <= trained.keys()
    assert all(torch.equal(promoted[k], trained[k]) for k in promoted)
    assert main(["status", paths.root]) == 0
    assert re.search(
        r"\npromoted +iteration 1 \(rolled back to .*, #3\) at .*/growing/promoted\n", capsys.readouterr().out
    )

    # a file that was read is rewritten: the next run fails naming it, before any iteration
    changed = drop / "2026-01-02.parquet"
    _write(changed, 50)
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    assert f"{changed} changed after the experiment read it" in str(state.result(raise_on_failure=False))
    assert read_manifest(paths).iteration == 2
