"""Asynchronous training end to end (2 CPU ranks per group, vLLM, one trained group: ``LIGHT``):
the ``ppo`` flow consumes batches that a ``ppo-rollout`` flow, started by it in a process of its
own, samples into the experiment's queue.

- ``max_staleness: 0`` commits exactly what the synchronous flow commits (``light_run``, the same
  config without the queue): every checkpoint bit for bit with its RNG states, the data cursor, the
  learning metrics, and the training batch of each iteration tensor for tensor. That is the proof
  that the queue, the producer's group and the trainer's ``old_log_prob`` step change nothing:
  the producer samples each batch in one call with the synchronous rollout's rows per rank and
  per-request seeds, and the trainer recomputes the old log-probs with the same rows per rank
  and micro-batches as ``generate`` does. The run that shows it is the durability drill too
  (``async_run``: the producer and the trainer SIGKILLed mid-push, the run resumed by the one
  command, ``ppoflow run``), so the equality holds through both faults and one experiment serves
  the three claims.
- every committed iteration n records in its manifest the batch it consumed (its hash is the hash
  of ``iterations/n/rollout.arrow``, a byte copy), and the consumed batches left the queue.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ppoflow.infra.data import storage
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.data.hashing import hash_file
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.experiment.metrics import is_timing_key
from ppoflow.infra.queue.layout import QueuePaths
from tests.support.configs import LIGHT
from tests.support.experiments import assert_same_state, copy_experiment
from tests.support.hf_log_probs import response_log_probs

pytestmark = pytest.mark.slow

ASYNC = {**LIGHT, "asynchronous.enable": True}


@pytest.fixture(scope="module")
def async_run(prefect_harness, flow_config, tmp_path_factory):
    """``light_run``'s config with asynchronous training at staleness 0, 2 iterations, through two
    faults: the trainer (``python -m ppoflow.flows.ppo``, a process of its own) SIGKILLs its
    producer while it loads policy version 1 for batch 2 (the trainer starts it again; the new one
    takes over the dead one's lease), then is SIGKILLed itself while it publishes version 2
    (weights written, pointer not moved); ``ppoflow run CONFIG`` (a Prefect API of its own)
    resumes from manifest 1 to its end. Returns the experiment's URL, the killed trainer's exit
    status and output, what storage held then, and the resuming command's exit status, output,
    the processes seen below it and those of them still alive after it (``resumed``)."""
    import subprocess
    import sys
    import time

    from prefect.settings import PREFECT_API_URL

    from ppoflow.infra.config import dump_config
    from ppoflow.infra.experiment.manifest import read_manifest
    from tests.support.paths import ROOT

    tmp_path = tmp_path_factory.mktemp("async-run")
    cfg = flow_config(str(tmp_path), "killed", **ASYNC)
    config = tmp_path / "killed.yaml"
    config.write_text(dump_config(cfg))
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "PPOFLOW_FAULT": "kill:policy_load:2,kill:publish:2",
    }
    t0 = time.perf_counter()
    trainer = subprocess.run(
        [sys.executable, "-m", "ppoflow.flows.ppo", str(config), "2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    url = cfg.storage.experiment_url
    queue, manifest = QueuePaths(url), read_manifest(ExperimentPaths(url))
    killed = {
        "returncode": trainer.returncode,
        "out": trainer.stdout + trainer.stderr,
        "iteration": manifest.iteration if manifest else None,
        "policy_2": storage.exists(queue.policy(2)),
        "done_2": storage.exists(queue.done(2)),
    }
    resume, log = _start_cli(config, tmp_path, 1, "resume.log")
    seen = _watch(resume, lambda: False)
    returncode = resume.wait(60)
    log.close()
    resumed = {
        "returncode": returncode,
        "out": (tmp_path / "resume.log").read_text(),
        "seen": seen,
        "left": _gone(seen),
    }
    assert returncode == 0 and read_manifest(ExperimentPaths(url)).iteration == 2, (
        killed["out"][-3000:] + resumed["out"][-3000:]
    )
    print(f"\n[timing] asynchronous run (s=0), killed twice and resumed: {time.perf_counter() - t0:.1f} s")
    return {"url": url, "killed": killed, "resumed": resumed}


def _learning_metrics(url: str, n: int) -> dict:
    """What an iteration learned and measured of its batch (not how the rollout was obtained)."""
    metrics = storage.read_json(ExperimentPaths(url).file(n, "metrics.json"))
    skip = ("rollout/", "async/", "weight_sync", "perf/")
    return {k: v for k, v in metrics.items() if not is_timing_key(k) and not k.startswith(skip)}


def test_staleness_zero_commits_what_the_synchronous_flow_commits(async_run, light_run):
    url = async_run["url"]
    sync, queued = ExperimentPaths(light_run), ExperimentPaths(url)
    for n in (1, 2):
        assert_same_state(sync.checkpoint("actor", n), queued.checkpoint("actor", n))
        ms, ma = (storage.read_json(p.file(n, "manifest.json")) for p in (sync, queued))
        assert ms["data_cursor"] == ma["data_cursor"]
        learned = _learning_metrics(url, n)
        assert learned == {k: v for k, v in _learning_metrics(light_run, n).items() if k in learned}
        a, b = (
            DataProto.load(sync.file(n, "advantages.arrow")),
            DataProto.load(queued.file(n, "advantages.arrow")),
        )
        assert set(a.batch) == set(b.batch) - {"token_versions"}
        diff = [k for k in a.batch if not torch.equal(a.batch[k], b.batch[k])]
        assert not diff, f"iteration {n}: the training batches differ in {diff}"
        metrics = storage.read_json(queued.file(n, "metrics.json"))
        assert metrics["async/staleness_max"] == 0.0 and metrics["async/version_min"] == n - 1
        assert metrics["async/publish_background"] == 0.0  # batch n + 1 needs version n itself
        sampled_by = b.batch["token_versions"][b.batch["response_mask"].bool()]
        assert sampled_by.numel() and bool((sampled_by == n - 1).all())  # every token: version n - 1


def test_each_commit_records_the_batch_it_consumed_and_retention_removes_it(async_run, capsys):
    import json

    from ppoflow.cli.main import main

    url = async_run["url"]
    paths = ExperimentPaths(url)
    for n in (1, 2):
        consumed = storage.read_json(paths.file(n, "manifest.json"))["consumed"]
        fs, path = storage.url_to_fs(paths.file(n, "rollout.arrow"))
        assert hash_file(fs, path) == (consumed["bytes"], consumed["xxh3"])
        assert consumed["file"].startswith(f"queue/batches/{n:06d}/") and consumed["versions"] == [
            n - 1,
            n - 1,
        ]
    queue = QueuePaths(url)
    assert [k for k in queue.batch_numbers() if k <= 2] == []
    assert storage.exists(queue.stop)
    assert os.path.isdir(queue.policy(2))
    assert main(["status", url]) == 0
    out = capsys.readouterr().out
    assert "rollout queue" in out and "newest policy version 2 (producers told to stop)" in out
    assert main(["status", url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["queue"]
    assert status["latest_version"] == 2 and status["batches"] == [] and status["stopped"]


# ----------------------------------------------------------------------------- durability
def test_a_producer_and_a_trainer_killed_mid_push_lose_nothing_and_resume_exactly(async_run, light_run):
    """The faults of ``async_run``: the killed trainer's run ended at manifest 1 with version 2's
    weights written and never pointed at; the run resumed from there commits what the
    uninterrupted synchronous run commits, and each batch was consumed once."""
    import signal

    killed, paths = async_run["killed"], ExperimentPaths(async_run["url"])
    out = killed["out"]
    assert killed["returncode"] == -signal.SIGKILL, out[-3000:]
    assert "killed at policy_load 2" in out and "starting it again" in out, out[-3000:]
    assert killed["iteration"] == 1
    assert killed["policy_2"] and killed["done_2"]  # version 2 never pointed at
    for n in (1, 2):
        assert_same_state(ExperimentPaths(light_run).checkpoint("actor", n), paths.checkpoint("actor", n))
        ms, ma = (storage.read_json(p.file(n, "manifest.json")) for p in (ExperimentPaths(light_run), paths))
        assert ms["data_cursor"] == ma["data_cursor"] and ma["consumed"]["versions"] == [n - 1, n - 1]
        fs, path = storage.url_to_fs(paths.file(n, "rollout.arrow"))
        assert hash_file(fs, path) == (ma["consumed"]["bytes"], ma["consumed"]["xxh3"])


# ----------------------------------------------------------------------------- one command
def _producers(pids: dict[int, str]) -> dict[int, str]:
    return {pid: cmd for pid, cmd in pids.items() if "ppoflow.flows.asynchronous.rollout" in cmd}


def _start_cli(config, tmp_path, iterations: int, log: str):
    """``ppoflow run CONFIG --iterations N`` as a user starts it (no Prefect API set: the command
    starts its own), its output into ``tmp_path / log``: the process and the open log."""
    import subprocess
    import sys

    from tests.support.paths import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PPOFLOW_FAULT"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=ROOT)
    out = open(tmp_path / log, "w")
    ppoflow = os.path.join(os.path.dirname(sys.executable), "ppoflow")
    cmd = [ppoflow, "run", str(config), "--iterations", str(iterations)]
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT), out


def _watch(proc, until, seconds: float = 600) -> dict[int, str]:
    """Every process below ``proc`` seen until ``until()`` (or its exit)."""
    import time

    from tests.support.processes import descendants

    seen: dict[int, str] = {}
    t0 = time.monotonic()
    while proc.poll() is None and not until() and time.monotonic() - t0 < seconds:
        for pid, cmd in descendants(proc.pid).items():
            if cmd:  # a zombie's command line reads empty
                seen.setdefault(pid, cmd)
        time.sleep(0.2)
    return seen


def _gone(pids: dict[int, str], seconds: float = 15) -> dict[int, str]:
    import time

    from tests.support.processes import alive

    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def test_one_command_runs_the_producer_beside_the_trainer_and_stops_it(async_run, flow_config, tmp_path):
    """``ppoflow run CONFIG`` with asynchronous training on starts the producer in a process of
    its own; at the end of the run (``async_run``'s resume) and on Ctrl-C (a run of a copy of that
    experiment) the producer, its ranks and the trainer's are gone (the stop marker written), and
    Ctrl-C exits as any run does."""
    import signal
    import time

    from ppoflow.infra.config import dump_config
    from ppoflow.infra.experiment.manifest import read_manifest
    from tests.support.processes import descendants

    resumed = async_run["resumed"]  # to its end
    paths, queue = ExperimentPaths(async_run["url"]), QueuePaths(async_run["url"])
    assert resumed["returncode"] == 0, resumed["out"][-3000:]
    assert _producers(resumed["seen"]), "no producer process ran:\n" + resumed["out"][-5000:]
    assert resumed["left"] == {} and read_manifest(paths).iteration == 2 and storage.exists(queue.stop)

    cfg = flow_config(str(tmp_path / "runs"), "killed", **ASYNC)
    queue = QueuePaths(copy_experiment(async_run["url"], str(tmp_path / "runs"), "killed"))
    config = tmp_path / "one-command.yaml"
    config.write_text(dump_config(cfg))
    run, out = _start_cli(config, tmp_path, 3, "run-2.log")  # Ctrl-C once the producer runs
    seen = _watch(run, lambda: bool(_producers(descendants(run.pid))))
    assert _producers(seen) or _producers(descendants(run.pid)), (tmp_path / "run-2.log").read_text()[-3000:]
    time.sleep(5)
    seen.update({pid: cmd for pid, cmd in descendants(run.pid).items() if cmd})
    t0 = time.monotonic()
    run.send_signal(signal.SIGINT)
    rc = run.wait(180)
    took = time.monotonic() - t0
    out.close()
    text = (tmp_path / "run-2.log").read_text()
    print(f"\nCtrl-C: exit {rc} after {took:.1f} s")
    assert rc == 130 and "ppoflow: stopped by Ctrl-C" in text, text[-3000:]
    assert took < 60  # the producer is stopped at once, not waited for
    assert _gone(seen) == {}, _gone(seen)
    assert storage.exists(queue.stop)


# ----------------------------------------------------------------------------- stale batches
STALE = {
    **ASYNC,
    "resources.nprocs": 1,
    "asynchronous.max_staleness": 1,
    "asynchronous.chunk_tokens": 2,  # 4 chunks per response of 8 tokens
    "algorithm.rollout_correction.tis": "token",
    "checkpoint.keep_last": None,  # the test reads the weights of every version
}


@pytest.fixture(scope="module")
def stale_run(prefect_harness, flow_config, tmp_path_factory):
    """Staleness 1, partial rollouts, TIS: 4 iterations on one rank per group. Batch 3 (started
    by version 1) is a straggler (``stall:chunk:3``): after its first chunk the producer waits for
    version 2, so its sequences span that weight update whatever the machine's speed."""
    import time

    from ppoflow.flows.ppo import ppo

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("PPOFLOW_FAULT", "stall:chunk:3")  # the producer's process inherits it

    cfg = flow_config(str(tmp_path_factory.mktemp("stale-run")), "stale", **STALE)
    t0 = time.perf_counter()
    try:
        assert ppo(cfg, iterations=4)["iteration"] == 4
    finally:
        monkeypatch.undo()
    print(
        f"\n[timing] asynchronous run (s=1, partial rollouts), init + 4 iterations: {time.perf_counter() - t0:.1f} s"
    )
    return cfg


def test_stale_batches_keep_the_bound_and_each_token_has_its_samplers_log_prob(stale_run, flow_assets):
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict

    paths, s = ExperimentPaths(stale_run.storage.experiment_url), 1
    mixed = 0
    for n in range(1, 5):
        batch = DataProto.load(paths.file(n, "advantages.arrow"))
        mask = batch.batch["response_mask"].bool()
        versions = batch.batch["token_versions"][mask]
        assert versions.min() >= max(0, n - 1 - s) and versions.max() <= n - 1, (n, versions.unique())
        metrics = storage.read_json(paths.file(n, "metrics.json"))
        assert metrics["async/staleness_max"] == float((n - 1) - versions.min())
        # version n was written in the background (version n - 1 was complete); the producer
        # loads only complete versions, and the bound above held with every one it sampled from
        assert metrics["async/publish_background"] == 1.0, n
        assert sum(metrics[f"async/tokens_staleness_{d}"] for d in range(s + 1)) == mask.sum()
        # every token's sampler log-prob is its own version's (a plain forward per version) ...
        sampled = batch.batch["rollout_log_probs"]
        for v in versions.unique().tolist():
            weights = load_full_state_dict(paths.checkpoint("actor", v))
            lp = response_log_probs(flow_assets["model"], batch, batch.meta_info["temperature"], weights)
            mine = mask & (batch.batch["token_versions"] == v)
            assert torch.allclose(sampled[mine], lp[mine], atol=1e-4), (n, v)
        # ... and the update weighs each token by pi_old / pi_sampler of that token (TIS, cap 2)
        ratio = torch.exp(batch.batch["old_log_probs"] - sampled).clamp(max=2.0)
        assert torch.allclose(batch.batch["rollout_is_weights"][mask], ratio[mask], atol=1e-6)
        assert any(k.startswith("correction/") for k in metrics)
        mixed += int(metrics["async/mixed_version_sequences"])
    print(f"\nsequences sampled across a weight update: {mixed}")
    assert mixed > 0, "no sequence spanned a weight update: partial rollouts were not exercised"
    three = DataProto.load(paths.file(3, "rollout.arrow"))
    mask = three.batch["response_mask"].bool()
    spans = [sorted(set(row[m].tolist())) for row, m in zip(three.batch["token_versions"], mask)]
    assert [1, 2] in spans, spans  # the straggler: its first chunk by version 1, the rest by 2


# ----------------------------------------------------------------------------- the demo learns
DEMO_ITERATIONS = 8
#: How far below the synchronous run's held-out score the asynchronous one may end (greedy
#: decoding on the demo's held-out problems), and how much both must rise from the warm start.
DEMO_BAND, DEMO_RISE = 0.15, 0.2


def _demo_learning(root: str, **over) -> tuple[float, float, str]:
    """The demo at its own shape for :data:`DEMO_ITERATIONS` iterations (``over``: config keys):
    the held-out score before and after, and the experiment's URL."""
    from ppoflow.demo.experiment import DemoSpec, prepare
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.experiment.manifest import read_manifest
    from ppoflow.infra.experiment.metrics import headline

    cfg = prepare(root, DemoSpec(overrides={"evaluation.every": DEMO_ITERATIONS, **over}), log=print)
    assert ppo(cfg, iterations=DEMO_ITERATIONS)["iteration"] == DEMO_ITERATIONS
    manifest = read_manifest(ExperimentPaths.of(cfg))
    h = headline("val")
    scores = [(r["iteration"], h.value(r)) for r in manifest.trend if h.key_in(r)]
    print(f"\n[demo {over or 'synchronous'}] held-out score by iteration: {scores}")
    assert scores[0][0] == 0 and scores[-1][0] == DEMO_ITERATIONS, scores
    return scores[0][1], scores[-1][1], cfg.storage.experiment_url


def test_the_demo_learns_at_staleness_two_into_the_synchronous_band(prefect_harness, tmp_path):
    """The demo's shape (64 prompts x 8 samples, 2 ranks per group) for a few iterations, once
    synchronous and once with ``max_staleness: 2`` and partial rollouts: the held-out score rises
    from the warm start in both and the asynchronous one ends within :data:`DEMO_BAND` of the
    synchronous one; every consumed token's recorded version is within the bound of 2."""
    base, sync, _ = _demo_learning(str(tmp_path / "sync"))
    over = {"asynchronous.enable": True, "asynchronous.max_staleness": 2, "asynchronous.chunk_tokens": 2}
    for built in ("models", "data"):  # the same warm-started model and problems, built once
        shutil.copytree(tmp_path / "sync" / built, tmp_path / "async" / built)
    base_a, late, url = _demo_learning(str(tmp_path / "async"), **over)
    assert base_a == base  # the same warm-started model and problems
    assert sync >= base + DEMO_RISE and late >= base + DEMO_RISE, (base, sync, late)
    assert late >= sync - DEMO_BAND, (sync, late)
    paths = ExperimentPaths(url)
    stale = 0
    for n in range(1, DEMO_ITERATIONS + 1):
        batch = DataProto.load(paths.file(n, "rollout.arrow"))
        versions = batch.batch["token_versions"][batch.batch["response_mask"].bool()]
        assert versions.min() >= max(0, n - 3) and versions.max() <= n - 1, (n, versions.unique())
        stale = max(stale, int(n - 1 - versions.min()))
    print(f"\nlargest staleness consumed: {stale}")
