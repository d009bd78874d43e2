"""Real tasks and reward services in the real flow (2 CPU ranks, the tiny policy):

- files written from two reasoning-gym tasks train an iteration and are evaluated, each held-out
  response scored by the task's own scorer (checked by calling reasoning-gym by hand);
- a reward service on 127.0.0.1 (tests/support/reward_server.py) scores training and evaluation
  alike: the evaluation's scores are the service's rule applied to its responses; its bearer
  token, from the environment, reaches it and is written nowhere: not in a file of the experiment,
  the console's or the log's lines, Prefect's database or result files, or the MLflow store;
- a service that answers malformed JSON (after a retry: a RewardError, not retried by the task)
  or stalls (retried by the scorer and the task, then the run fails) leaves nothing committed.

Transformers generates, on the actor's own module (``rollout.engine: hf``): the claims are about
tasks and scoring, not the engine, and a group starts in about half vLLM's time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pickle
import re
import secrets
import sqlite3
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest

from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.configs import LIGHT_HF
from tests.support.prefect_runs import attempts
from tests.support.reward_server import calls, serve

pytestmark = pytest.mark.slow

EVAL = {"evaluation.before_training": True, "evaluation.at_end": True, "evaluation.every": 0}


def _generations(url: str) -> dict[str, list]:
    return _read_arrow(url).to_pydict()


#: The service's bearer token (/auth answers HTTP 401 to any other): new each session, so that no
#: earlier run can have left it anywhere.
TOKEN = f"rt-{secrets.token_hex(16)}"


@pytest.fixture(scope="module")
def service():
    from tests.support.ports import free_port

    with serve(free_port(), token=TOKEN) as url:
        yield url


def _forms(secret: str) -> list[bytes]:
    """``secret``'s bytes as a file could hold them: as they are, or inside base64 (Prefect's
    result files are base64 pickles) at each of the three alignments, standard and URL-safe."""
    raw = secret.encode()
    forms = [raw]
    for pad in range(3):
        start, end = -(-8 * pad // 6), 8 * (pad + len(raw)) // 6  # the characters of raw's bits only
        for encode in (base64.b64encode, base64.urlsafe_b64encode):
            forms.append(encode(b"\0" * pad + raw)[start:end])
    return forms


def _holds(data: bytes, secret: str) -> bool:
    return any(form in data for form in _forms(secret))


def _file_text(path: Path) -> bytes:
    """A file's bytes, and for Arrow and Parquet files (which may compress) their values too."""
    import pyarrow.parquet as pq

    data = path.read_bytes()
    if path.suffix == ".parquet":
        data += str(pq.read_table(str(path)).to_pylist()).encode()
    elif path.suffix == ".arrow":
        try:
            table = _read_arrow(str(path))
        except pa.ArrowInvalid:  # an Arrow stream, not a file
            with pa.OSFile(str(path)) as f:
                table = pyarrow.ipc.open_stream(f).read_all()
        data += str(table.to_pylist()).encode()
    return data


def _read_arrow(url: str) -> pa.Table:
    with pa.OSFile(url) as f:
        return pyarrow.ipc.open_file(f).read_all()


def _files_holding(root: Path, secret: str, since: float = 0.0) -> tuple[int, list[str]]:
    """How many files under ``root`` (modified at ``since`` or later) were read, and those that hold
    ``secret``."""
    files = [p for p in root.rglob("*") if p.is_file() and p.stat().st_mtime >= since]
    return len(files), [str(p) for p in files if _holds(_file_text(p), secret)]


def _prefect_database() -> str:
    """The file of Prefect's database: the test harness's SQLite."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    url = PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    assert url.startswith("sqlite+aiosqlite:///"), url
    return url.removeprefix("sqlite+aiosqlite:///")


def _prefect_database_text() -> bytes:
    """The bytes of Prefect's database files (its WAL too) and the text of every table's rows."""
    path = _prefect_database()
    parts = [Path(path + end).read_bytes() for end in ("", "-wal") if os.path.exists(path + end)]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        tables = [row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            parts.extend(repr(row).encode() for row in db.execute(f'SELECT * FROM "{table}"'))
    return b"\n".join(parts)


def _logged(flow_run_id: object) -> list[str]:
    """The log lines Prefect's database holds of a flow run (its tasks' too)."""
    with contextlib.closing(sqlite3.connect(f"file:{_prefect_database()}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT message FROM log WHERE flow_run_id = ?", (str(flow_run_id),))
        return [row[0] for row in rows]


def test_a_flow_trains_and_evaluates_on_reasoning_gym_tasks(prefect_harness, flow_config, tmp_path):
    rg = pytest.importorskip("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.datasets.reasoning_gym import TaskMix, TaskSpec, write_task_mix

    mix = TaskMix(
        tasks=[TaskSpec(name="basic_arithmetic"), TaskSpec(name="leg_counting")],
        train=8,
        test=4,
        system_prompt=None,
    )
    files = write_task_mix(mix, str(tmp_path / "data"))
    cfg = flow_config(
        str(tmp_path / "runs"),
        "rg",
        **LIGHT_HF,
        **EVAL,
        **{
            "data.train_files": [files["train"]],
            "data.val_files": [files["test"]],
            "rollout.prompt_length": 32,
        },
    )
    assert ppo(cfg, iterations=1)["iteration"] == 1
    paths = ExperimentPaths.of(cfg)
    metrics = json.loads(open(paths.file(1, "metrics.json")).read())
    for task in ("basic_arithmetic", "leg_counting"):
        assert f"val/reasoning_gym/{task}/score/mean@1" in metrics
    gen = _generations(paths.file(1, "eval/val/generations.arrow"))
    rows = pq_rows(files["test"])
    by_hand = []
    for i, text in zip(gen["index"], gen["response"]):
        info = rows[i]["extra_info"]
        entry = json.loads(info["reasoning_gym_entry"])
        by_hand.append(rg.get_score_answer_fn(info["task"])(extract_answer(text), entry))
    assert gen["score"] == pytest.approx(by_hand)


def pq_rows(url: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(url).to_pylist()


def test_a_reward_service_scores_training_and_evaluation(
    prefect_harness, flow_config, flow_assets, tmp_path, service, monkeypatch, capfd, caplog
):
    """The service scores every row, with the bearer token of ``$PPOFLOW_REWARD_TOKEN`` (the
    config's default ``token_env``: /auth refuses any other token, which would fail the run), and
    the token is then searched for, as it is and in base64, in everything the run wrote: the
    experiment's files (Arrow, JSON, metrics, manifest, checkpoints), the console and the log
    records (ppoflow's and httpx's at DEBUG), Prefect's database (its file and every table's rows)
    and result files, and the MLflow store (``MLFLOW_TRACKING_URI``: a ``file:`` store)."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import get_current_settings

    from ppoflow.flows.ppo import ppo

    for name in ("ppoflow", "httpx", "httpcore"):
        caplog.set_level(logging.DEBUG, logger=name)
    monkeypatch.setenv("PPOFLOW_REWARD_TOKEN", TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for this opt-in
    monkeypatch.chdir(tmp_path)  # MLflow's own defaults, if any, land under tmp_path
    endpoint = f"{service}/auth"
    before = calls(service)["calls"].get("auth", 0)
    since = time.time() - 1  # (file times are coarser than time.time on some filesystems)
    cfg = flow_config(
        str(tmp_path / "runs"),
        "remote",
        **LIGHT_HF,
        **EVAL,
        **{
            "data.val_files": [flow_assets["data"]],
            "evaluation.max_prompts": 4,
            "reward.rule": False,
            "reward.remote": {"endpoint": endpoint, "batch_size": 3},
        },
    )
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.result()["iteration"] == 1
    paths = ExperimentPaths.of(cfg)
    for n in (0, 1):  # before training and after: scored by the service, as its rule says
        gen = _generations(paths.file(n, "eval/val/generations.arrow"))
        assert gen["score"] == pytest.approx([sum(c.isdigit() for c in t) / 10 for t in gen["response"]])
    # two evaluations of 4 rows (2 requests each) and the training batch's 8 responses (3 requests)
    assert calls(service)["calls"]["auth"] - before == 2 * 2 + 3

    # the search finds what is there: the token hidden in a base64 pickle at every alignment
    assert all(_holds(base64.b64encode(pickle.dumps("x" * k + TOKEN)), TOKEN) for k in range(3))
    # the experiment's files: the config is stored there, with the variable's name and no token
    n, holding = _files_holding(tmp_path / "runs", TOKEN)
    assert holding == [] and n > 10
    assert _files_holding(tmp_path / "runs", "PPOFLOW_REWARD_TOKEN")[1]
    # the MLflow store: the config's params (the endpoint among them), metrics, artifacts
    n, holding = _files_holding(tmp_path / "mlruns", TOKEN)
    assert holding == [] and _files_holding(tmp_path / "mlruns", endpoint)[1]
    # the console (the ranks' output too) and the log records
    out, err = capfd.readouterr()
    console = out + err + "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert f"HTTP Request: POST {endpoint}" in console
    in_console = _holds(console.encode(), TOKEN)  # (a bool: a failure does not print it all)
    assert not in_console, "the token is in the console's output or a log record"
    # Prefect's database: the flow run's parameters (the config: its endpoint) and its log lines
    APILogWorker.drain_all(timeout=10)  # what this process holds, sent (and written: the server
    deadline = time.monotonic() + 30  # writes a batch before it answers; the loop is a guard)
    summary = re.compile(r"iteration +1 \| score ")  # the run's last line of its own
    while not any(map(summary.match, _logged(state.state_details.flow_run_id))):
        assert time.monotonic() < deadline, "the run's log lines did not reach Prefect's database"
        time.sleep(0.5)
    database = _prefect_database_text()
    assert endpoint.encode() in database
    in_database = _holds(database, TOKEN)
    assert not in_database, "the token is in Prefect's database"
    # Prefect's result files (base64 pickles), any written during the run
    results = get_current_settings().results.local_storage_path
    if results.exists():
        assert _files_holding(results, TOKEN, since)[1] == []


@pytest.mark.parametrize(
    "route, error, tries",
    [("malformed", "RewardError", 1), ("stall", "RewardServiceError", 3)],
)
def test_a_failing_service_commits_nothing(
    prefect_harness, flow_config, tmp_path, service, route, error, tries
):
    from ppoflow.flows.ppo import ppo

    remote = {
        "endpoint": f"{service}/{route}",
        "timeout_s": 0.5,
        "retries": 1,
        "backoff_s": 0.05,
        "token_env": None,
    }
    cfg = flow_config(
        str(tmp_path / "runs"), route, **LIGHT_HF, **{"reward.rule": False, "reward.remote": remote}
    )
    state = ppo(cfg, iterations=1, return_state=True)
    assert state.is_failed()
    result = state.result(raise_on_failure=False)
    assert error in repr(result) and f"reward service {service}/{route}" in str(result)
    assert attempts(state)["advantage"] == tries  # malformed answers: not retried; a stall: retried
    manifest = read_manifest(ExperimentPaths.of(cfg))
    assert manifest is None or manifest.iteration == 0
