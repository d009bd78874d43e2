"""W&B offline runs read back the way W&B reads them: ``wandb leet inspect --json`` (W&B's public
CLI that prints a run's ``.wandb`` transaction log, one JSON record a line) for the run, its config
and its history, and the table files the history points at (``files/media/table/*.table.json``)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
from typing import Any


def use_local_wandb_dirs(monkeypatch: Any, tmp_path: Any) -> None:
    """W&B's own directories (staged table artifacts, caches, settings) under ``tmp_path``, not
    the home directory; its error reports off (there is no network)."""
    for var, sub in (
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
    ):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


@dataclasses.dataclass
class OfflineRun:
    """One ``offline-run-*`` directory: one flow run's part of a W&B run."""

    path: str
    run_id: str
    project: str
    tags: list[str]
    config: dict[str, Any]  # as of the end of this part (the run's config, then its updates)
    history: list[tuple[int, dict[str, Any]]]  # (step, the logged row), in order

    def table(self, step: int, key: str) -> list[dict[str, Any]]:
        """The rows of table ``key`` logged at ``step``."""
        item = dict(self.history)[step]
        with open(os.path.join(self.path, "files", item[f"{key}.path"])) as f:
            table = json.load(f)
        return [dict(zip(table["columns"], row)) for row in table["data"]]


def offline_runs(wandb_dir: str) -> list[OfflineRun]:
    """Every ``offline-run-*`` directory under ``wandb_dir``, oldest first, read in parallel."""
    paths = sorted(glob.glob(os.path.join(wandb_dir, "offline-run-*")))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in paths
    ]
    return [_parse(path, *proc.communicate(timeout=120), proc.returncode) for path, proc in zip(paths, procs)]


def _parse(path: str, out: str, err: str, rc: int) -> OfflineRun:
    assert rc == 0, f"wandb leet inspect {path}: {err}"
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    [run] = [r["run"] for r in records if r["type"] == "run"]
    config = {k: v for k, v in run.get("config", {}).get("update", {}).items() if k != "_wandb"}
    history = []
    for r in records:
        if r["type"] == "config":
            config.update(r["config"].get("update", {}))
        elif r["type"] == "history":
            item = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            history.append((int(r["history"]["step"]["num"]), item))
    return OfflineRun(path, run["run_id"], run["project"], list(run.get("tags", [])), config, history)
