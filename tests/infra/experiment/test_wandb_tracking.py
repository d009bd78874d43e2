"""W&B tracking with the real SDK in offline mode (no server, no network): what two flow runs and
a rollback send is what W&B's own reader (``wandb leet inspect --json``, its public CLI for a run's
``.wandb`` log) reads back from the run directories; and the pure pieces (run ids, steps, where the
files go, the preflight's problems, the import only when configured)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys

from ppoflow.infra.config import parse_config
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment import wandb_tracking
from ppoflow.infra.experiment.wandb_tracking import (
    RUN_FILE,
    WandbTracker,
    new_run_id,
    next_step,
    run_dir,
    wandb_problems,
)
from tests.support.wandb_runs import offline_runs, use_local_wandb_dirs

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["x.parquet"], "train_batch_size": 4},
    "actor": {"ppo_mini_batch_size": 4, "optim": {"lr": 1e-6}},
    "critic": {"ppo_mini_batch_size": 4},
    "seed": 7,
}
SECRET = "0123456789abcdef0123456789abcdef0123abcd"


def _config(root, mode="offline", **wandb):
    return parse_config(
        {
            **BASE,
            "storage": {"root": str(root), "experiment": "exp"},
            "tracking": {"wandb": {"mode": mode, **wandb}},
        }
    )


def test_run_ids_are_new_per_experiment_and_steps_never_go_back():
    ids = {new_run_id("exp") for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("exp-") and len(i) == 12 for i in ids)
    long = new_run_id("x" * 128)
    assert long.startswith("x" * 48 + "-") and len(long) == 57
    assert next_step(1, -1) == 1 and next_step(5, 4) == 5  # step = iteration, normally
    assert next_step(4, 5) == 6  # iteration 4 again after a rollback from 5: after everything
    assert next_step(5, 6) == 7 and next_step(6, 7) == 8
    assert next_step(3, 2, run_step=9) == 9  # a resumed online run that has more than wandb.json


def test_where_the_run_files_go(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_DIR", raising=False)
    local = _config(tmp_path / "runs")
    assert run_dir(local.tracking.wandb, str(tmp_path / "runs" / "exp")) == str(tmp_path / "runs" / "exp")
    assert run_dir(local.tracking.wandb, "s3://bucket/runs/exp") is None  # W&B's default, ./wandb
    mine = _config(tmp_path / "runs", dir=str(tmp_path / "w"))
    assert run_dir(mine.tracking.wandb, "s3://bucket/runs/exp") == str(tmp_path / "w")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "env"))
    assert run_dir(local.tracking.wandb, str(tmp_path / "runs" / "exp")) is None  # W&B reads its own


def test_the_preflight_names_a_missing_key_and_a_dir_it_cannot_write(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    online = _config(tmp_path, mode="online")
    [(where, found, fix)] = wandb_problems(online)
    assert where == "tracking.wandb (mode: online)" and "WANDB_API_KEY is not set" in found
    assert "mode: offline" in fix and "wandb sync" in fix
    warnings: list[str] = []
    assert WandbTracker.of(online, str(tmp_path / "exp"), warnings.append) is None  # no login prompt
    assert len(warnings) == 1 and "WANDB_API_KEY is not set" in warnings[0]
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    assert wandb_problems(online) == []
    assert wandb_problems(_config(tmp_path, mode="offline")) == []
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root writes anywhere
        [(where, found, _)] = wandb_problems(_config(tmp_path, dir=str(locked / "w")))
        assert where == f"tracking.wandb.dir={locked / 'w'}" and "cannot be written" in found


def test_without_wandb_installed_only_a_config_that_turns_it_on_is_refused(tmp_path, monkeypatch):
    """``wandb`` imported only when configured: the module imports without it, a config without
    W&B (or with it disabled) runs, and one with it on is refused saying how to install it."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    module = importlib.reload(wandb_tracking)
    warnings: list[str] = []
    off = parse_config({**BASE, "storage": {"root": str(tmp_path), "experiment": "exp"}})
    assert module.WandbTracker.of(off, str(tmp_path / "exp"), warnings.append) is None and warnings == []
    assert (
        module.wandb_problems(off) == [] and module.wandb_problems(_config(tmp_path, mode="disabled")) == []
    )
    assert module.wandb_problems(_config(tmp_path, mode="offline")) == [
        (
            "tracking.wandb (mode: offline)",
            "the wandb package is not installed in the environment that runs the flows",
            "pip install 'ppoflow[wandb]' there, or remove tracking.wandb (or set its mode: disabled)",
        )
    ]
    assert module.WandbTracker.of(_config(tmp_path), str(tmp_path / "exp"), warnings.append) is None
    assert len(warnings) == 1 and "pip install 'ppoflow[wandb]'" in warnings[0]


def _samples(root: str, n: int, text: str) -> list[dict]:
    rows = [{"row": 0, "prompt": f"{n}+1=", "response": text, "score": 1.0, "reward": 1.0, "advantage": 0.5}]
    os.makedirs(os.path.join(root, "iterations", f"{n:06d}"), exist_ok=True)
    with open(os.path.join(root, "iterations", f"{n:06d}", "samples.json"), "w") as f:
        json.dump(rows, f)
    return rows


def _iteration(n: int, score: float) -> dict:
    return {"iteration": n, "timestamp": 1.7e9 + n, "critic/score/mean": score, "val/gsm/pass@4": 0.25}


def test_two_flow_runs_and_a_rollback_are_one_run_whose_steps_only_go_up(tmp_path, monkeypatch):
    use_local_wandb_dirs(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)  # offline: never needed, and never written
    root = str(tmp_path / "runs" / "exp")
    generations = _evaluation_of_zero(root)
    cfg = _config(tmp_path / "runs", tags=["smoke"], group="g")
    rows = {n: _samples(root, n, f"answer {n}") for n in (1, 2)}
    warnings: list[str] = []

    first = WandbTracker.of(cfg, root, warnings.append)  # flow run 1: iterations 1 and 2
    assert first is not None
    first.start(cfg.model_dump(mode="json"))
    first.log_iteration(1, _iteration(1, 0.5))
    first.log_iteration(2, {**_iteration(2, 0.75), "actor/kl": float("nan"), "flag": True})
    first.finish()
    record = json.load(open(os.path.join(root, RUN_FILE)))
    assert record["step"] == 2 and record["iteration"] == 2 and record["id"].startswith("exp-")

    # flow run 2, after `ppoflow rollback --to 1`: iteration 2 again (new samples), then 3
    old_two = rows[2]
    rows[2], rows[3] = _samples(root, 2, "another answer"), _samples(root, 3, "answer 3")
    changed = parse_config({**cfg.model_dump(mode="json"), "seed": 8})
    second = WandbTracker.of(changed, root, warnings.append)
    assert second is not None
    second.start(changed.model_dump(mode="json"))
    second.log_iteration(2, _iteration(2, 0.625))
    second.log_iteration(3, _iteration(3, 0.875))
    second.finish()
    assert warnings == []

    runs = offline_runs(os.path.join(root, "wandb"))
    assert len(runs) == 2 and {r.run_id for r in runs} == {record["id"]}  # one W&B run, resumed
    assert all(r.project == "ppoflow" and r.tags == ["smoke"] for r in runs)
    steps = [(step, item["iteration"]) for r in runs for step, item in r.history]
    assert steps == [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3)]  # the re-committed 2 after the old 2
    history = {step: item for r in runs for step, item in r.history}
    assert history[0]["val/score"] == 0.125 and history[0]["val/prompts"] == 8.0
    assert runs[0].table(0, "eval/samples") == generations
    assert history[1]["critic/score/mean"] == 0.5 and history[1]["val/gsm/pass@4"] == 0.25
    assert (
        history[2]["critic/score/mean"] == 0.75 and "actor/kl" not in history[2] and "flag" not in history[2]
    )
    assert history[3]["critic/score/mean"] == 0.625 and history[4]["critic/score/mean"] == 0.875
    tables = [runs[0].table(1, "samples"), runs[0].table(2, "samples")]
    tables += [runs[1].table(3, "samples"), runs[1].table(4, "samples")]
    assert tables == [rows[1], old_two, rows[2], rows[3]]
    assert runs[0].config["actor.optim.lr"] == 1e-6 and runs[0].config["seed"] == 7
    assert runs[0].config["tracking.wandb.tags"] == ["smoke"]
    assert runs[1].config["seed"] == 8  # the second flow run's setting replaces the first's

    # a copy of the experiment under another name is another experiment: a W&B run of its own
    fork = str(tmp_path / "runs" / "fork")
    shutil.copytree(root, fork, ignore=shutil.ignore_patterns("wandb"))
    forked = parse_config(
        {**cfg.model_dump(mode="json"), "storage": {"root": str(tmp_path / "runs"), "experiment": "fork"}}
    )
    third = WandbTracker.of(forked, fork, warnings.append)
    assert third is not None
    third.start(forked.model_dump(mode="json"))
    third.log_iteration(4, _iteration(4, 1.0))
    third.finish()
    again = json.load(open(os.path.join(fork, RUN_FILE)))
    assert (
        again["id"].startswith("fork-") and (again["step"], again["iteration"]) == (4, 4) and warnings == []
    )
    for folder, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                assert SECRET.encode() not in f.read(), os.path.join(folder, name)


def _evaluation_of_zero(root: str) -> list[dict]:
    """Iteration 0's evaluation as the ``evaluate`` task leaves it; the rows W&B's table shows."""
    zero = os.path.join(root, "iterations", "000000", "eval", "val")
    os.makedirs(zero)
    with open(os.path.join(zero, "metrics.json"), "w") as f:
        json.dump({"val/score": 0.125, "val/prompts": 8.0}, f)
    rows = [
        {"index": i, "data_source": "gsm", "prompt": f"{i}+1=", "response": str(i + 1), "score": float(i % 2)}
        for i in range(10)
    ]
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    DataProto.from_dict(non_tensors=columns).save(os.path.join(zero, "generations.arrow"))
    return rows[:8]  # evaluation.samples_shown
