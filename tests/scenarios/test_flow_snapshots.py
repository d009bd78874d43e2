"""Snapshots every k iterations and exact replay in the real flow (2 CPU ranks, an actor and a
critic group; transformers generates on the actor's own module, ``rollout.engine: hf``: the claims
are about states, replay and resumes, not the engine, and each of the family's dozen group starts
takes about half vLLM's time), against an uninterrupted run of the same config that writes every
state (``checkpoint.snapshot_every: 1``):

- snapshots between the ends of runs are deferred (a commit does not wait for their writes);
- a flow SIGKILLed between two snapshots, and a rank killed between two snapshots, resume by
  replaying the stored updates since the snapshot and commit the same metrics, data cursors and
  snapshots (weights, optimizer state, every rank's RNG) bit for bit;
- a state rebuilt on another number of ranks (2 -> 1) from a snapshot plus replay equals the lost
  one up to float rounding (the updates' reductions run in another order);
- a rollback to, and an export of, an iteration between snapshots equal what the uninterrupted
  run had there;
- a batch a replay needs, missing or damaged, is named with the iterations it makes
  unrecoverable and the way out (a rollback to the snapshot).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.config import dump_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.experiments import assert_same_state, comparable_metrics, copy_experiment
from tests.support.prefect_runs import attempts

pytestmark = pytest.mark.slow

K = 3
ITERATIONS = 6
#: an actor and a critic group (GAE), nothing else: no reward model, no KL term, no vLLM; snapshots
#: only every K (not at the end of each run: the runs here stop between snapshots on purpose)
TWO_GROUPS = {
    "rollout.engine": "hf",
    "reward.reward_model.enable": False,
    "algorithm.use_kl_in_reward": False,
    "checkpoint.snapshot_at_end": False,
}


def _same_iterations(ref: str, url: str, iterations, states=("actor", "critic"), may_lose=()) -> None:
    """Metrics and data cursors of ``iterations`` equal; their snapshots equal bit for bit (a
    deferred snapshot in ``may_lose``, whose write a kill may have cut, only where it is complete)."""
    pr, pu = ExperimentPaths(ref), ExperimentPaths(url)
    for n in iterations:
        assert comparable_metrics(url, n) == comparable_metrics(ref, n), n
        mu, mr = (storage.read_json(p.file(n, "manifest.json")) for p in (pu, pr))
        assert mu["data_cursor"] == mr["data_cursor"] and mu["actor_checkpoint"] == mr["actor_checkpoint"]
        if n % K == 0:
            for role in states:
                if n in may_lose and not is_complete(pu.checkpoint(role, n)):
                    continue
                assert is_complete(pu.checkpoint(role, n))
                assert_same_state(pr.checkpoint(role, n), pu.checkpoint(role, n))
        else:
            assert not is_complete(pu.checkpoint("actor", n)), f"iteration {n} wrote its state"


@pytest.fixture(scope="module")
def reference(prefect_harness, flow_config, tmp_path_factory):
    from ppoflow.flows.ppo import ppo

    cfg = flow_config(
        str(tmp_path_factory.mktemp("every-state")), "every", **TWO_GROUPS, **{"checkpoint.keep_last": None}
    )
    ppo(cfg, iterations=ITERATIONS)
    return cfg


@pytest.fixture(scope="module")
def snapped(reference, flow_config, tmp_path_factory):
    """The same experiment with snapshots every K: 4 iterations in one run, then 2 more in a second
    run in which rank 1 of the actor group dies in its first update (iteration 5)."""
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.runtime import faults

    cfg = flow_config(
        str(tmp_path_factory.mktemp("snapped")), "snapped", **TWO_GROUPS, **{"checkpoint.snapshot_every": K}
    )
    ppo(cfg, iterations=4)
    faults.reset()
    os.environ[faults.ENV_VAR] = "rank_exit:update_actor:1"
    try:
        state = ppo(cfg, iterations=2, return_state=True)
    finally:
        os.environ.pop(faults.ENV_VAR)
        faults.reset()
    assert state.is_completed()
    return cfg, attempts(state)


def test_a_killed_rank_between_snapshots_is_rebuilt_by_replay(reference, snapped):
    cfg, tries = snapped
    # rank 1 died in its group's first update: the replay of iteration 4 that iteration 5's rollout
    # needed (snapshot 3 + one update); the task was retried on a rebuilt group, which replayed again
    assert tries["generate"] == 2 and tries["update_actor"] == 1
    paths = ExperimentPaths.of(cfg)
    manifest = read_manifest(paths)
    assert manifest.iteration == ITERATIONS and manifest.replay == {}  # 6 is a snapshot
    # 3 is a deferred snapshot (its commit did not wait for the write); by commit 5 it was written,
    # and 5's chain starts after it: snapshot 3 + 2 updates
    assert storage.read_json(paths.receipt(3, "update_actor"))["replay"]["actor"]["snapshot"] == "deferred"
    m5 = storage.read_json(paths.file(5, "manifest.json"))
    assert [e["iteration"] for e in m5["replay"]["actor"]] == [4, 5]
    metrics5 = storage.read_json(paths.file(5, "metrics.json"))
    assert metrics5["replay/actor_updates"] == 1 and metrics5["timing_s/replay_actor"] > 0
    _same_iterations(reference.storage.experiment_url, cfg.storage.experiment_url, range(1, ITERATIONS + 1))


def test_a_flow_killed_between_snapshots_resumes_exactly(reference, flow_config, tmp_path):
    """``ppoflow run`` SIGKILLed once iteration ``at``'s actor update is recorded, twice on one
    experiment: in iteration 2 (nothing written), then, resumed by the CLI, in the snapshot
    iteration 3, whose write may be cut (then the resumed run rebuilds state 3 from snapshot 0
    when it needs it). What each kill left committed, and everything the last run commits, equals
    the uninterrupted run."""
    from ppoflow.flows.ppo import ppo

    cfg = flow_config(str(tmp_path / "runs"), "killed", **TWO_GROUPS, **{"checkpoint.snapshot_every": K})
    paths = ExperimentPaths.of(cfg)
    config = tmp_path / "killed.yaml"
    config.write_text(dump_config(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PPOFLOW_FAULT"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PPOFLOW_SLOTS_DIR=str(tmp_path / "slots"))
    cli = [os.path.join(os.path.dirname(sys.executable), "ppoflow"), "run", str(config), "--iterations", "6"]
    ref = reference.storage.experiment_url
    for at in (2, K):
        log_path = tmp_path / f"cli-killed-at-{at}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cli, env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 600
            while not storage.exists(paths.receipt(at, "update_actor")):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        committed = read_manifest(paths).iteration
        assert committed in range(at + 1)
        _same_iterations(ref, cfg.storage.experiment_url, range(1, committed + 1), may_lose=(K,))
    ppo(cfg, iterations=ITERATIONS - committed)
    _same_iterations(ref, cfg.storage.experiment_url, range(1, ITERATIONS + 1), may_lose=(K,))


def test_another_rank_count_rebuilds_a_state_from_a_snapshot_plus_replay(
    reference, snapped, flow_config, tmp_path
):
    """State 5 (snapshot 3 + the updates of 4 and 5, made on 2 ranks) rebuilt on 1 rank, as a resume
    on 1 rank rebuilds it: the same weights and optimizer state up to float rounding (the updates'
    reductions run in another order). The next rollout would differ anyway: its per-request seeds
    depend on the data-parallel layout."""
    from ppoflow.tasks.run.materialize import materialize_state

    cfg, _ = snapped
    url = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "snapped")
    one = flow_config(
        str(tmp_path), "snapped", **TWO_GROUPS, **{"checkpoint.snapshot_every": K, "resources.nprocs": 1}
    )
    ref, paths = ExperimentPaths.of(reference), ExperimentPaths(url)
    for role in ("actor", "critic"):
        out = materialize_state(one, role, paths.checkpoint(role, 5), str(tmp_path / f"rebuilt-{role}"))
        assert_same_state(ref.checkpoint(role, 5), out, exact=False, atol=1e-5)


def test_rollback_and_export_between_snapshots_equal_the_uninterrupted_run(
    reference, snapped, flow_config, tmp_path, capsys
):
    from ppoflow.cli.main import main
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.checkpoint.sharded import load_full_state_dict

    cfg, _ = snapped
    url = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "snapped")
    ref = ExperimentPaths.of(reference)
    out = tmp_path / "hf-4"
    assert main(["export-hf", url, str(out), "--iteration", "4"]) == 0  # rebuilt: snapshot 3 + update 4
    assert "rebuilt the actor's state of iteration 4" in capsys.readouterr().out
    from safetensors.torch import load_file

    exported = load_file(str(out / "model.safetensors"))
    want = load_full_state_dict(ref.checkpoint("actor", 4))
    assert all(torch.equal(exported[k], want[k]) for k in exported), "export of iteration 4 differs"
    assert not storage.exists(storage.join(url, "scratch")) or not storage.listdir(
        storage.join(url, "scratch")
    )

    assert main(["rollback", url, "--to", "4"]) == 0
    again = flow_config(str(tmp_path), "snapped", **TWO_GROUPS, **{"checkpoint.snapshot_every": K})
    ppo(again, iterations=1)  # rebuilds state 4 from snapshot 3, then commits 5
    assert comparable_metrics(url, 5) == comparable_metrics(ref.root, 5)


def test_a_missing_or_damaged_batch_names_what_it_costs_and_the_way_out(snapped, tmp_path, capsys):
    from ppoflow.cli.main import main
    from ppoflow.infra.experiment.rollback import RollbackRefused, rollback
    from ppoflow.infra.preflight import PreflightError, preflight
    from tests.support.configs import tokenizer_of

    cfg, _ = snapped
    url = copy_experiment(cfg.storage.experiment_url, str(tmp_path), "snapped")
    paths = ExperimentPaths(url)
    batch = paths.file(4, "advantages.arrow")
    with open(batch, "r+b") as f:  # flip one byte, size unchanged
        f.seek(os.path.getsize(batch) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RollbackRefused, match=r"rebuilt from .*000004/advantages.arrow, which is damaged"):
        rollback(paths, 5)
    assert main(["export-hf", url, str(tmp_path / "out"), "--iteration", "5"]) == 1
    err = capsys.readouterr().err
    assert "iterations/000004/advantages.arrow of iteration 4 is damaged" in err
    assert "iterations 4-5 of the actor cannot be rebuilt" in err and f"ppoflow rollback {url} --to 3" in err

    os.remove(batch)
    storage.write_json_atomic(paths.manifest, storage.read_json(paths.file(5, "manifest.json")))  # at 5
    moved = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"root": str(tmp_path)})})
    with pytest.raises(PreflightError) as info:
        preflight(moved, lambda: tokenizer_of(cfg.model.tokenizer))
    text = str(info.value)
    assert "000004/advantages.arrow of iteration 4 is missing" in text and "--to 3" in text
