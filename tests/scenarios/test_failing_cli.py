"""Failing well, as a user of ``ppoflow run`` sees it: the real console script in a subprocess, its
own temporary Prefect server (a fresh ``PREFECT_HOME`` per module), real ranks and vLLM.

- a failed run prints one error block (cause, task, log, next step), exits 1, no traceback
  unless ``--verbose``, no success summary, none of Prefect's noise;
- ``kill -9`` of the ``ppoflow run`` process mid-iteration leaves no rank, torchrun, vLLM or
  Prefect server process behind; the next run takes over the lock and the device slots at once
  and commits what an uninterrupted run commits;
- SIGTERM while starting or while waiting for device slots, and Ctrl-C in the middle of a task,
  end the run within seconds, release the lock and the slots, and leave nothing running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ppoflow.infra.config import dump_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.configs import LIGHT, LIGHT_HF
from tests.support.experiments import assert_same_commit
from tests.support.processes import alive, descendants, free_by_flock

pytestmark = pytest.mark.slow

PPOFLOW = os.path.join(os.path.dirname(sys.executable), "ppoflow")
NOISE = (
    "Traceback",
    "database is locked",
    "EventsWorker",
    "Still processing items",
    "continue training:",
    "temporary server",
)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-prefect-home")


@pytest.fixture
def cli(home, tmp_path):
    """Start ``ppoflow ARGS`` (output to a file); ``.text()`` reads it so far."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PPOFLOW_FAULT"))}
    env.update(
        PREFECT_HOME=str(home),
        PPOFLOW_SLOTS_DIR=str(tmp_path / "slots"),
        PPOFLOW_DEVICE_SLOTS="2",
        PYTHONPATH=os.getcwd(),
    )
    started = []

    class Run:
        def __init__(self, *args: str):
            self.log = tmp_path / f"cli-{len(started)}.log"
            self.out = open(self.log, "w")
            self.proc = subprocess.Popen(
                [PPOFLOW, *args], env=env, stdout=self.out, stderr=subprocess.STDOUT, cwd=os.getcwd()
            )
            self.t0 = time.monotonic()
            started.append(self)

        def text(self) -> str:
            return self.log.read_text()

        def wait_for(self, condition, timeout: float = 600) -> float:
            while not condition():
                assert self.proc.poll() is None, f"ppoflow exited ({self.proc.returncode}):\n{self.text()}"
                assert time.monotonic() - self.t0 < timeout, f"timed out:\n{self.text()}"
                time.sleep(0.1)
            return time.monotonic() - self.t0

        def finish(self, timeout: float = 900) -> int:
            return self.proc.wait(timeout)

    yield Run
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.out.close()


def write_config(tmp_path, cfg) -> str:
    path = tmp_path / f"{cfg.storage.experiment}.yaml"
    path.write_text(dump_config(cfg))
    return str(path)


def signal_and_time(run, sig: int) -> tuple[dict[int, str], int, float]:
    """Snapshot the run's process tree, send ``sig``; (tree, exit status, seconds to exit)."""
    tree = descendants(run.proc.pid)
    t0 = time.monotonic()
    run.proc.send_signal(sig)
    rc = run.proc.wait(120)
    return tree, rc, time.monotonic() - t0


def gone_within(tree: dict[int, str], seconds: float) -> dict[int, str]:
    """The processes of ``tree`` still alive after waiting up to ``seconds`` for them to go."""
    deadline = time.monotonic() + seconds
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(tree)


# ------------------------------------------------------------------------------ the failure screen


def test_a_failed_run_prints_one_error_block(cli, flow_config, flow_assets, tmp_path):
    import pyarrow.parquet as pq

    bad = str(tmp_path / "no_prompt.parquet")
    pq.write_table(pq.read_table(flow_assets["data"]).drop(["prompt"]), bad)
    cfg = flow_config(str(tmp_path / "runs"), "bad", **LIGHT, **{"data.train_files": [bad]})
    run = cli("run", write_config(tmp_path, cfg), "--iterations", "1")
    assert run.finish() == 1
    out = run.text()
    print(f"\n--- what the user saw ({time.monotonic() - run.t0:.0f} s) ---\n{out}")
    assert out.count("ppoflow: the run failed") == 1
    block = out[out.index("ppoflow: the run failed") :]
    assert block.startswith("ppoflow: the run failed in task preflight (1 attempt, not retried")
    assert "  cause  PreflightError: preflight found 1 problem(s)" in block
    assert f"{bad}: missing column(s) ['prompt']" in block
    assert (
        "  state  the experiment has no committed iteration yet; the experiment lock and this run's device slots are free"
        in block
    )
    assert "  log    " in block and "flow-run logs " in block
    assert "  next   fix what the cause names (a retry cannot), then run: " in block
    assert f"bin/ppoflow run {tmp_path / 'bad.yaml'} --iterations 1" in block
    assert not [n for n in NOISE if n in out], out

    # a second run while the experiment is locked by a live process; --verbose adds the traceback
    good = flow_config(str(tmp_path / "runs"), "locked", **LIGHT)
    paths = ExperimentPaths.of(good)
    from ppoflow.infra.experiment.lock import ExperimentLock

    with ExperimentLock(paths.lock, run_id="the-other-run"):
        run = cli("run", write_config(tmp_path, good), "--verbose")
        assert run.finish() == 1
    out = run.text()
    block = out[out.index("ppoflow: the run failed") :]
    assert block.startswith("ppoflow: the run failed after")
    assert "  cause  ExperimentLocked: experiment lock" in block and "held by flow run the-other-run" in block
    assert "  next   wait for the run named above to end (or cancel it), then run:" in block
    assert "Traceback (most recent call last)" in block  # --verbose
    assert "continue training:" not in out


# ------------------------------------------------------------------------------ SIGKILL


def test_sigkill_mid_iteration_leaves_nothing_and_the_next_run_commits_the_same(
    cli, light_run, flow_config, tmp_path
):
    root = str(tmp_path / "runs")
    cfg = flow_config(root, "exp", **LIGHT)
    paths = ExperimentPaths.of(cfg)
    config = write_config(tmp_path, cfg)

    run = cli("run", config, "--iterations", "2")
    at = run.wait_for(lambda: storage.exists(paths.receipt(1, "generate")))
    tree, rc, _ = signal_and_time(run, signal.SIGKILL)
    # what was running: the local API, and torch's launcher with its ranks (forked: one command line)
    assert any("local_api" in c for c in tree.values()), tree
    assert sum("remote.rank.launch" in c for c in tree.values()) >= 2, tree
    assert rc == -signal.SIGKILL
    t0 = time.monotonic()
    left = gone_within(tree, 10)
    print(
        f"\nkilled {at:.0f} s into the run; its {len(tree)} processes were gone {time.monotonic() - t0:.1f} s later"
    )
    assert left == {}, f"left running after kill -9: {left}"
    server_log = next(c for c in tree.values() if "local_api" in c).split()[4]
    assert not os.path.exists(server_log)  # the server cleaned up after itself
    assert read_manifest(paths).iteration == 0 and storage.exists(paths.lock)  # a stale lock remains
    assert free_by_flock(tmp_path / "slots", "cpu", 2) == [0, 1]  # the kernel freed its slots

    again = cli("run", config, "--iterations", "2")
    assert again.finish() == 0, again.text()
    out = again.text()
    assert (
        "taking over the stale experiment lock" in out
        and f"process {run.proc.pid} on this host is gone" in out
    )
    assert "waiting for 2 of this machine's" not in out  # the slots were free at once
    assert read_manifest(paths).iteration == 2
    for n in (1, 2):
        assert_same_commit(light_run, cfg.storage.experiment_url, n, roles=("actor",))


# ------------------------------------------------------------------------------ signals

HOLDER = """
import time
from tests.support.configs import slots_config as config
from ppoflow.infra.remote.driver.slots import device_slots
with device_slots(config(), print, run_id="the-holder"):
    print("HELD", flush=True)
    time.sleep(600)
"""


def test_sigterm_while_starting_and_while_waiting_for_slots(cli, flow_config, tmp_path):
    cfg = flow_config(str(tmp_path / "runs"), "waiting", **LIGHT)
    paths = ExperimentPaths.of(cfg)
    config = write_config(tmp_path, cfg)

    # SIGTERM (or Ctrl-C) while it is still importing and starting (mostly imports: a signal raised
    # inside one of torch's once aborted the process, exit -6), and just as the flow begins
    for delay, sig, name in (
        (1.0, signal.SIGTERM, "SIGTERM"),
        (3.0, signal.SIGINT, "Ctrl-C"),
        (5.0, signal.SIGTERM, "SIGTERM"),
    ):
        run = cli("run", config)
        time.sleep(delay)
        tree, rc, took = signal_and_time(run, sig)
        print(f"\n{name} {delay:.0f} s after start: exit {rc} after {took:.1f} s\n{run.text()}")
        assert rc == 128 + sig and took < 20 and gone_within(tree, 10) == {}
        assert f"ppoflow: stopped by {name}" in run.text() and "Traceback" not in run.text()

    slots = tmp_path / "slots"
    env = {
        **os.environ,
        "PPOFLOW_SLOTS_DIR": str(slots),
        "PPOFLOW_DEVICE_SLOTS": "2",
        "PYTHONPATH": os.getcwd(),
    }
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().startswith("holding")
        run = cli("run", config)
        run.wait_for(
            lambda: (
                "waiting for 2 of this machine's 2 cpu device slot(s), held by run the-holder" in run.text()
            )
        )
        assert storage.exists(paths.lock)
        tree, rc, took = signal_and_time(run, signal.SIGTERM)
        print(f"SIGTERM while waiting for device slots: exit {rc} after {took:.1f} s\n{run.text()}")
        assert rc == 143 and took < 20
        assert "ppoflow: stopped by SIGTERM" in run.text() and "Traceback" not in run.text()
        assert gone_within(tree, 10) == {}
        assert not storage.exists(paths.lock)  # released
        assert free_by_flock(slots, "cpu", 2) == [] and holder.poll() is None  # the holder's, untouched
    finally:
        holder.kill()
        holder.wait()


def test_ctrl_c_mid_task_stops_within_seconds_and_frees_everything(cli, flow_config, tmp_path):
    cfg = flow_config(str(tmp_path / "runs"), "interrupted", **LIGHT)
    paths = ExperimentPaths.of(cfg)
    run = cli("run", write_config(tmp_path, cfg), "--iterations", "2")
    run.wait_for(lambda: storage.exists(paths.file(1, "prompts.arrow")))  # generate is running
    tree, rc, took = signal_and_time(run, signal.SIGINT)
    out = run.text()
    print(f"\nCtrl-C in generate: exit {rc} after {took:.1f} s\n{out}")
    assert sum("remote.rank.launch" in c for c in tree.values()) >= 2  # a launcher and its ranks ran
    assert rc == 130 and took < 20
    assert "ppoflow: stopped by Ctrl-C" in out and "  state  iteration 0 is the last committed" in out
    assert "Traceback" not in out
    assert gone_within(tree, 10) == {}
    assert not storage.exists(paths.lock)
    assert free_by_flock(tmp_path / "slots", "cpu", 2) == [0, 1]


# ------------------------------------------------------------------------------ a full disk


def fill(directory) -> int:
    """Write ``directory/filler`` until its filesystem is full; the bytes written."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(chunk)
        except OSError as exc:
            assert exc.errno == 28, exc
    return written


@pytest.fixture
def small_filesystem(tmp_path):
    """A 48 MB tmpfs at ``tmp_path/small`` (mounting needs root, as CI has), unmounted after."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); CI runs as root and can")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def check_failed_on_full_disk(run, paths, took: float, last: int) -> None:
    """One error block naming the full disk and the way out, exit 1 within a minute, no traceback,
    the manifest at ``last``, every published checkpoint whole, no lock left behind."""
    from ppoflow.infra.checkpoint.marker import MARKER, verify_checkpoint

    out = run.text()
    print(f"\nthe run exited {run.proc.returncode} {took:.1f} s after the disk was full\n{out}")
    assert run.proc.returncode == 1 and took < 60
    assert out.count("ppoflow: the run failed") == 1 and "Traceback" not in out
    block = out[out.index("ppoflow: the run failed") :]
    assert "No space left on device" in block
    assert f"  next   free space where the experiment is stored ({paths.root}" in block
    assert read_manifest(paths).iteration == last
    for role in ("actor", "critic"):
        root = storage.join(paths.root, "checkpoints", role)
        for name in storage.listdir(root) if storage.exists(root) else []:
            if storage.exists(storage.join(root, name, MARKER)):
                verify_checkpoint(storage.join(root, name))  # what was published is whole
    assert not storage.exists(paths.lock)


def test_a_storage_root_that_fills_up_fails_the_run_within_a_minute(
    cli, flow_config, small_filesystem, tmp_path
):
    """The experiment on a small real filesystem (every iteration writes its state). It fills up
    mid-run, then, freed, is left with room for an iteration's batches (~100 kB) but not for its
    checkpoint (~2 MB), so the iteration's state writes are what meet the full disk. Each time the run ends
    within a minute with one error block that names the full disk and says to free space; with
    space freed the same command resumes and commits. (Transformers generates, on the actor's own
    module: the engine has no part in this, and each of the four runs starts its group in half
    vLLM's time.)"""
    cfg = flow_config(str(small_filesystem / "runs"), "full", **LIGHT_HF, **{"checkpoint.snapshot_every": 1})
    paths = ExperimentPaths.of(cfg)
    config = write_config(tmp_path, cfg)
    filler = small_filesystem / "filler"

    run = cli("run", config, "--iterations", "4")
    run.wait_for(lambda: (read_manifest(paths) or type("M", (), {"iteration": 0})).iteration >= 1)
    fill(small_filesystem)
    t0 = time.monotonic()
    run.finish(timeout=180)
    last = read_manifest(paths).iteration
    assert 1 <= last < 4
    check_failed_on_full_disk(run, paths, time.monotonic() - t0, last)

    os.truncate(filler, max(0, os.path.getsize(filler) - (640 << 10)))  # 640 kB free
    run = cli("run", config, "--iterations", "2")
    writing = storage.join(paths.root, "checkpoints", "actor", f"{last + 1:06d}")
    run.wait_for(lambda: storage.exists(writing))  # the update of the next iteration saves its state
    t0 = time.monotonic()
    run.finish(timeout=180)
    log = run.text()
    check_failed_on_full_disk(run, paths, time.monotonic() - t0, last)
    assert "(1 attempt, not retried: a retry cannot fix this)" in log
    # what meets the full disk is one of the iteration's state writes, whichever comes first: an
    # update task's checkpoint or receipt (both roles write at once), or the commit that waits for
    # a checkpoint written in the background
    failed_task = log[log.index("ppoflow: the run failed in task ") :].split()[6]
    assert failed_task in {f"{t}-{last + 1}" for t in ("update_actor", "update_critic", "commit")}, log

    os.remove(filler)
    again = cli("run", config, "--iterations", "1")
    assert again.finish() == 0, again.text()
    assert read_manifest(paths).iteration == last + 1


def test_a_full_disk_met_by_the_evaluation_names_the_disk_not_the_commit(
    cli, flow_config, flow_assets, small_filesystem, tmp_path
):
    """The evaluation is what meets the full disk: the disk fills the moment it has written its
    prompts and while it generates (no checkpoint is written in that iteration, so nothing else
    writes). The commit, which takes the evaluation's result, then never runs; the run still ends
    within a minute with the full disk as its cause and the advice to free space, not Prefect's
    "UnfinishedRun: Run is in PENDING state" with the advice to run again."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(flow_assets["data"]).to_pylist()
    val = str(tmp_path / "val.parquet")  # enough prompts that generating them takes a while
    pq.write_table(
        pa.Table.from_pylist([dict(r, extra_info={"index": i}) for i, r in enumerate(rows * 8)]), val
    )
    over = {
        "data.val_files": [val],
        "evaluation.before_training": False,
        "checkpoint.snapshot_every": 100,
        "checkpoint.snapshot_at_end": False,
    }
    cfg = flow_config(str(small_filesystem / "runs"), "evalfull", **LIGHT, **over)
    paths = ExperimentPaths.of(cfg)
    run = cli("run", write_config(tmp_path, cfg), "--iterations", "1")
    prompts = paths.file(1, "eval/val/prompts.arrow")
    run.wait_for(lambda: storage.exists(paths.receipt(1, "update_actor")))
    while not os.path.exists(prompts):  # the evaluation has begun: generating now
        assert run.proc.poll() is None, run.text()
        time.sleep(0.005)
    fill(small_filesystem)
    t0 = time.monotonic()
    run.finish(timeout=180)
    check_failed_on_full_disk(run, paths, time.monotonic() - t0, 0)
    out = run.text()
    block = out[out.index("ppoflow: the run failed") :]
    assert block.startswith("ppoflow: the run failed in task evaluate-1 (1 attempt, not retried")
    assert "UnfinishedRun" not in out and "PENDING" not in out
    assert not storage.exists(paths.receipt(1, "evaluate"))
