"""The README's deployment steps, for real: a Prefect server, a process work pool, ``prefect deploy``
of ``prefect.yaml``, a process worker, ``prefect deployment run ppo/iteration``, the evaluation
deployment, and the retraining deployment twice (the entrypoints of ``ppoflow.flows.deployment``
and the ``ppo-retrain`` flow of ``ppoflow.flows.retrain``, with their embedded default experiment).

Everything runs as the shell commands the README's deployment section gives (the ``prefect`` next to the
interpreter running pytest, i.e. ``.venv/bin/prefect``), against a server on a free port of
127.0.0.1 whose ``PREFECT_HOME`` (database, profiles) is a temporary directory: nothing touches
``~/.prefect``. The deployment is the checkout's ``prefect.yaml`` unchanged, deployed from the
repository root; only its ``demo_storage`` default is pointed at a temporary directory
(``--param``), so the runs build and train the embedded default experiment there and not in the
checkout's ``runs/``. The iteration run initialises it (iteration 0) and commits iteration 1; the
first retraining run continues to 2.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.support.paths import ROOT
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

REPO = Path(ROOT)
POOL = "ppoflow"  # the work pool prefect.yaml names


def _prefect_cli() -> str:
    """The ``prefect`` executable of the interpreter running the tests (``.venv/bin/prefect``)."""
    beside = Path(sys.executable).parent / "prefect"
    found = str(beside) if beside.exists() else shutil.which("prefect")
    assert found, "no `prefect` executable beside the interpreter or on PATH"
    return found


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return f"--- {path.name} (last {n} chars) ---\n{text[-n:]}"


class _Service:
    """A long-running command in its own session, output to a log file; :meth:`stop` ends it and
    every process it started (the worker's flow-run processes and their rank groups run in
    sessions of their own, so they are found by parentage, not by process group)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path):
        self.name, self.log = name, logdir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, signals: tuple[int, ...] = (signal.SIGTERM,), grace_s: float = 15.0) -> list[int]:
        """Send ``signals`` in turn to the process group (each after the previous one was given
        ``grace_s``), then SIGKILL; then end any descendant still running. Returns the pids of
        the descendants that had to be ended here."""
        tree = self.descendants()
        for sig in (*signals, signal.SIGKILL):
            if not self.alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.proc.wait(timeout=30)
        leftover = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in leftover:
            p.terminate()
        _, still = psutil.wait_procs(leftover, timeout=10)
        for p in still:
            p.kill()
        psutil.wait_procs(still, timeout=10)
        return [p.pid for p in leftover]


def _api_get(api: str, path: str) -> dict:
    with urllib.request.urlopen(f"{api}{path}", timeout=10) as r:
        return json.loads(r.read())


def _wait_healthy(server: _Service, api: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.alive(), f"prefect server exited\n{_tail(server.log)}"
        try:
            if _api_get(api, "/health") is True:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"prefect server not healthy after {timeout_s:.0f} s\n{_tail(server.log)}")


def _post(api: str, path: str, body: dict) -> Any:
    req = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _retraining(cli: Any, api: str, demo_storage: str, worker: _Service, lap: Any, t: float) -> float:
    """The nightly loop's deployment, run twice by hand: ``rule=always`` trains iteration 2 (the
    experiment continued from the iteration run's 1) and promotes it; a run with ``iterations=0``
    and a gain no score can reach keeps it. Each run leaves its event and its decision artifact;
    ``<experiment>/promoted`` loads as the model of iteration 2."""
    from transformers import AutoModelForCausalLM

    from ppoflow.flows.deployment import default_config
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict
    from ppoflow.infra.experiment.manifest import ExperimentPaths
    from ppoflow.infra.experiment.promotion import current_promotion, promoted_url
    from ppoflow.tasks.step import artifact_slug

    cli("--no-prompt", "deploy", "-n", "retrain", "--param", f"demo_storage={demo_storage}")
    dep = _api_get(api, "/deployments/name/ppo-retrain/retrain")
    assert dep["entrypoint"] == "ppoflow.flows.retrain:retrain"
    [schedule] = dep["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["active"] is False
    runs = []
    for params in (["-p", "rule=always"], ["-p", "iterations=0", "-p", "min_gain=1000"]):
        run = cli(
            "deployment", "run", "ppo-retrain/retrain", *params, "--watch", "--watch-timeout", "600",
            timeout=660, check=False,
        )  # fmt: skip
        t = lap(f"retrain {params[1]}", t)
        assert run.returncode == 0 and "finished successfully in 'Completed'" in run.stdout, (
            f"the retraining run did not complete\n{run.stdout[-6000:]}\n{_tail(worker.log, 8000)}"
        )
        runs.append(run.stdout)
    cfg = default_config(demo_storage)
    paths = ExperimentPaths.of(cfg)
    record = current_promotion(paths)
    assert record is not None and (record["seq"], record["iteration"], record["action"]) == (1, 2, "promote")
    assert record["flow_run_id"] in runs[0] and record["metrics"]["val/score"] == record["value"]
    promoted = AutoModelForCausalLM.from_pretrained(promoted_url(paths)).state_dict()
    trained = load_full_state_dict(paths.checkpoint("actor", 2))
    assert all(torch.equal(promoted[k], trained[k].to(promoted[k].dtype)) for k in promoted)
    # the server stores events in batches after they arrive: the second run's may land after the
    # run is reported complete, so wait for it (a run that emitted nothing still fails here)
    want = [("ppoflow.policy.kept", 2), ("ppoflow.policy.promoted", 2)]
    deadline = time.monotonic() + 60
    while True:
        events = _post(
            api, "/events/filter", {"filter": {"event": {"prefix": ["ppoflow.policy."]}}, "limit": 10}
        )
        got = sorted((e["event"], e["payload"]["iteration"]) for e in events["events"])
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert got == want, got
    key = f"{artifact_slug(cfg.storage.experiment)}-promotion"
    arts = _post(api, "/artifacts/filter", {"artifacts": {"key": {"any_": [key]}}})
    texts = sorted(a["data"] for a in arts)
    assert len(texts) == 2 and "**kept**" in texts[0] and "**promoted**" in texts[1], texts
    return t


@pytest.mark.timeout(1800)  # four deployment runs; about 5 min on an idle 2-core machine
def test_deploy_run_evaluate_and_retrain(tmp_path):
    from ppoflow.flows.deployment import default_config
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

    t0 = time.monotonic()
    prefect = _prefect_cli()
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    logs = tmp_path / "logs"
    logs.mkdir()
    demo_storage = str(tmp_path / "demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_CLI_COLORS="false",
        PREFECT_CLI_WRAP_LINES="false",
    )
    prefect_yaml = (REPO / "prefect.yaml").read_bytes()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        timings[name] = time.monotonic() - since
        return time.monotonic()

    def cli(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        if check:
            assert done.returncode == 0, (
                f"`prefect {' '.join(args)}` exited {done.returncode}\n"
                f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    server = worker = None
    try:
        server = _Service(
            "server", [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, logs
        )
        _wait_healthy(server, api)
        t = lap("server start", t0)

        cli("work-pool", "create", POOL, "--type", "process")
        cli("--no-prompt", "deploy", "-n", "iteration", "--param", f"demo_storage={demo_storage}")
        t = lap("pool + deploy", t)
        assert (REPO / "prefect.yaml").read_bytes() == prefect_yaml, "prefect deploy rewrote prefect.yaml"

        # What prefect.yaml promises, as the server holds it.
        dep = _api_get(api, "/deployments/name/ppo/iteration")
        assert dep["entrypoint"] == "ppoflow.flows.deployment:iteration" and dep["work_pool_name"] == POOL
        assert dep["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
        ]  # this checkout, resolved at deploy
        assert dep["parameters"] == {"iterations": 1, "demo_storage": demo_storage}
        assert dep["global_concurrency_limit"]["limit"] == 1
        assert dep["schedules"] == []  # the nightly schedule is the retraining deployment's

        worker = _Service("worker", [prefect, "worker", "start", "--pool", POOL], env, logs)
        iterations = []
        for attempt in (1,):
            run = cli(
                "deployment",
                "run",
                "ppo/iteration",
                "--watch",
                "--watch-timeout",
                "600",
                timeout=660,
                check=False,
            )
            t = lap(f"run {attempt}", t)
            assert run.returncode == 0 and "finished successfully in 'Completed'" in run.stdout, (
                f"run {attempt} did not complete (exit {run.returncode})\n{run.stdout[-6000:]}\n"
                f"{run.stderr[-3000:]}\n{_tail(worker.log, 8000)}"
            )
            # The run built the embedded default under demo_storage (nothing else did); from
            # then on default_config only reads its config.yaml.
            manifest = read_manifest(ExperimentPaths.of(default_config(demo_storage)))
            iterations.append(manifest.iteration if manifest else None)
        assert iterations == [1], f"manifest iteration after the run: {iterations}"

        # The evaluation deployment on the demo's iteration 1, with the held-out file under another
        # name (so it is evaluated again, not found): the same scores as training's evaluation.
        cfg = default_config(demo_storage)
        paths = ExperimentPaths.of(cfg)
        copy = tmp_path / "heldout.parquet"
        shutil.copy(cfg.data.val_files[0], copy)
        cli("--no-prompt", "deploy", "-n", "evaluate", "--param", f"demo_storage={demo_storage}")
        run = cli(
            "deployment",
            "run",
            "ppo-eval/evaluate",
            "-p",
            "iteration=1",
            "-p",
            f'files=["{copy}"]',
            "--watch",
            "--watch-timeout",
            "600",
            timeout=660,
            check=False,
        )
        t = lap("evaluation run", t)
        assert run.returncode == 0 and "finished successfully in 'Completed'" in run.stdout, (
            f"the evaluation run did not complete\n{run.stdout[-6000:]}\n{_tail(worker.log, 8000)}"
        )
        trained = json.loads(open(paths.file(1, "eval/val/metrics.json")).read())
        tags = [t for t in os.listdir(paths.file(1, "eval")) if t.startswith("files-")]
        assert len(tags) == 1, os.listdir(paths.file(1, "eval"))
        again = json.loads(open(paths.file(1, f"eval/{tags[0]}/metrics.json")).read())
        assert (
            again["val/score"] == trained["val/score"]
            and again["val/prompts"] == trained["val/prompts"] == 100
        )
        t = _retraining(cli, api, demo_storage, worker, lap, t)
        # The flow-run processes (and their rank groups) exit by themselves after the runs.
        deadline = time.monotonic() + 60
        while worker.descendants() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not worker.descendants(), (
            f"processes still running under the worker: "
            f"{[(p.pid, p.cmdline()[:4]) for p in worker.descendants()]}"
        )
    finally:
        # The worker first (it talks to the server). Prefect 3.9.1's worker does not always stop
        # on its first SIGTERM (it sends itself SIGINT, and sometimes keeps polling); on a second
        # one it SIGKILLs itself.
        ended = {}
        if worker is not None:
            ended["worker"] = worker.stop((signal.SIGTERM, signal.SIGTERM), grace_s=5.0)
        if server is not None:
            ended["server"] = server.stop((signal.SIGTERM,), grace_s=20.0)
    print(
        f"\ndeployment test: {time.monotonic() - t0:.0f} s in all; "
        + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
    )
    assert not any(ended.values()), f"processes left running after the runs: {ended}"
