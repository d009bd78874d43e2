"""Failing well, part three, as a user of ``ppoflow run`` sees it (the real CLI in a subprocess,
``tests.support.cli``): the demo's kind of config with one change each, and each ends within
seconds with one clear error, before any rank starts where it can be known before.

- an experiment name that climbs out of the storage root (or takes a name of the root's own
  files) is refused with the config's errors: nothing is written anywhere, on local disk or on
  an S3 bucket (moto's server);
- a rank count this machine cannot hold is refused by the preflight, before any rank starts;
- a worker group whose ranks cannot start (a real misconfiguration: gloo told to use a network
  interface that does not exist) fails the run once, well within the connect timeout, with the
  rank's error and the ranks' last output lines, and is not retried;
- a held-out file whose rows lack ``reward_model.ground_truth`` is found by the preflight.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from ppoflow.infra.config import dump_config
from ppoflow.infra.preflight.resources import ACTOR_RANK_MIB, available_memory_mib
from tests.support.cli import CLIRun, cli_env
from tests.support.configs import LIGHT
from tests.support.processes import alive

pytestmark = pytest.mark.slow

RANKS = ("remote.rank.launch", "remote.rank.entry", "torch.distributed.run")  # launchers and ranks
#: What a config error costs the CLI: its imports and the config's checks, no Prefect server.
CONFIG_ERROR_S = 30
#: What the preflight's checks may take: about a second on an idle machine (a tokenizer, a few
#: parquet footers and rows, one storage probe); 9 s were seen with a load average of 18 on 2 cores.
PREFLIGHT_S = 20
#: Past the connect timeout, what the end of a run whose group cannot start may take on a busy
#: 2-core machine: torchrun's report and exit (the ranks' imports come first: ~3 CPU-seconds each),
#: the flow's teardown (lock, slots, the Prefect server).
START_MARGIN_S = 30


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-prefect-home")


@pytest.fixture
def cli(home, tmp_path):
    """``cli(*args, **env)``: start ``ppoflow ARGS`` with ``env`` added to its environment."""
    runs: list[CLIRun] = []

    def start(*args: str, **env: str) -> CLIRun:
        run = CLIRun(tmp_path / f"cli-{len(runs)}.log", cli_env(home, tmp_path / "slots", **env), *args)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


def write_config(tmp_path, cfg, name: str = "config") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_config(cfg))
    return str(path)


def files_under(path) -> set[str]:
    return {os.path.join(d, f) for d, _, names in os.walk(path) for f in names} | {
        os.path.join(d, s) for d, subs, _ in os.walk(path) for s in subs
    }


def error_block(out: str) -> str:
    assert out.count("ppoflow: the run failed") == 1, out
    return out[out.index("ppoflow: the run failed") :]


def preflight_seconds(block: str) -> float:
    """What the preflight's checks took, as its error says."""
    import re

    found = re.search(r"nothing was started \(the checks took ([0-9.]+) s\)", block)
    assert found, block
    return float(found.group(1))


def test_an_experiment_name_that_leaves_the_root_is_refused_and_nothing_is_written(
    cli, flow_config, tmp_path
):
    area = tmp_path / "area"  # the root's parent: where "../escape" would land
    root = area / "runs"
    root.mkdir(parents=True)
    (root / "config.yaml").write_text("# the root's own file\n")
    config = write_config(tmp_path, flow_config(str(root), "exp", **LIGHT))
    before = files_under(area)
    for name, said in (
        ("../escape", "'../escape' is not a valid experiment name (one directory under storage.root)"),
        ("config.yaml", "'config.yaml' is a name ppoflow keeps beside the experiments at a storage root"),
    ):
        run = cli("run", config, "--set", f"storage.experiment={name}")
        rc, took = run.finish()
        out = run.text()
        print(f"\n--- storage.experiment={name}: exit {rc} after {took:.1f} s ---\n{out}")
        assert rc == 2 and out.startswith(f"ppoflow: error: invalid {config}:")
        assert f"  storage.experiment: Value error, {said}" in out
        assert "letters, digits, '.', '_' and '-'" in out or "name the experiment otherwise" in out
        assert took < CONFIG_ERROR_S and run.started(*RANKS, "local_api") == []  # nothing started
    assert files_under(area) == before  # nothing written, inside the root or beside it


def test_on_s3_nothing_is_written_in_the_bucket(cli, flow_config, tmp_path, s3_server):
    import s3fs

    bucket = s3_server["bucket"]
    root = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/runs"
    fs = s3fs.S3FileSystem()
    fs.pipe(f"{root.removeprefix('s3://')}/config.yaml", b"# the root's own file\n")
    config = write_config(tmp_path, flow_config(root, "exp", **LIGHT))

    def keys() -> list[str]:
        fs.invalidate_cache()
        return sorted(fs.find(bucket))

    before = keys()
    run = cli("run", config, "--set", "storage.experiment=../../escape")
    rc, took = run.finish()
    out = run.text()
    print(f"\n--- an S3 root, storage.experiment=../../escape: exit {rc} after {took:.1f} s ---\n{out}")
    assert rc == 2 and "storage.experiment: Value error, '../../escape' is not a valid experiment name" in out
    assert keys() == before  # no key anywhere in the bucket, inside the root's prefix or out of it


def test_a_rank_count_this_machine_cannot_hold_is_refused_before_any_rank_starts(cli, flow_config, tmp_path):
    free = available_memory_mib()
    assert free is not None
    n = 2
    while n * ACTOR_RANK_MIB <= 2 * free:  # ranks that need twice the memory this machine has free
        n *= 2
    cfg = flow_config(
        str(tmp_path / "runs"),
        "big",
        **LIGHT,
        **{
            "data.train_batch_size": n,
            "actor.ppo_mini_batch_size": n,
            "actor.ppo_micro_batch_size_per_gpu": 1,
        },
    )
    run = cli("run", write_config(tmp_path, cfg), "--set", f"resources.nprocs={n}")
    rc, took = run.finish()
    out = run.text()
    print(f"\n--- resources.nprocs={n} ({free} MiB free): exit {rc} after {took:.1f} s ---\n{out}")
    assert rc == 1
    block = error_block(out)
    assert block.startswith("ppoflow: the run failed in task preflight (1 attempt, not retried")
    # the measured rank runtime and the memory plan's peak stage on top: at least the runtime alone
    head = f"resources.nprocs={n}: 1 worker group(s) x {n} ranks need at least "
    assert head in block
    need = float(block.split(head, 1)[1].split(" GiB", 1)[0])
    assert need >= n * ACTOR_RANK_MIB / 1024 and "the memory plan's" in block
    assert "lower resources.nprocs to at most" in block
    assert run.started("ppoflow.cli.local_api") and run.started(*RANKS) == []  # before any rank started
    assert preflight_seconds(block) < PREFLIGHT_S  # the rest is the CLI's and Prefect's start


def test_a_group_whose_ranks_cannot_start_fails_the_run_once_within_the_connect_timeout(
    cli, flow_config, tmp_path
):
    timeout = 60
    config = write_config(tmp_path, flow_config(str(tmp_path / "runs"), "unstartable", **LIGHT))
    run = cli(
        "run",
        config,
        "--verbose",
        "--set",
        f"resources.connect_timeout_s={timeout}",
        GLOO_SOCKET_IFNAME="nosuchif0",
    )
    started_at = None
    while run.proc.poll() is None:
        if started_at is None and "starting the actor worker group" in run.text():
            started_at = time.monotonic()
        time.sleep(0.1)
    rc, took = run.finish()
    ended_at = run.t0 + took
    out = run.text()
    assert started_at is not None, out
    print(
        f"\n--- ranks that cannot start: exit {rc}, {ended_at - started_at:.1f} s after the group's start "
        f"({took:.1f} s in all) ---\n{out[-6000:]}"
    )
    assert rc == 1
    block = error_block(out)
    assert block.startswith(
        "ppoflow: the run failed in task init (1 attempt, not retried: a retry cannot fix this)"
    )
    assert (
        "  cause  GroupCannotStart: the actor worker group cannot start: torchrun exited (status 1) before "
        "all ranks connected (0/2 had)" in block
    )
    assert "exited with status 1 while starting: RuntimeError: " in block
    assert "Unable to find address for: nosuchif0" in block  # the cause, in the block's first lines
    assert "--- last output lines of the ranks/torchrun ---" in block  # --verbose: the ranks' output too
    assert out.count("starting the actor worker group") == 1  # one start: not retried
    assert ended_at - started_at < timeout + START_MARGIN_S
    ranks = [pid for pid, cmd in run.seen.items() if any(r in cmd for r in RANKS)]
    assert ranks and alive(ranks) == {}  # its ranks ran, and none is left


def test_a_held_out_file_without_ground_truth_is_found_by_the_preflight(
    cli, flow_config, flow_assets, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(flow_assets["data"]).to_pylist()
    for row in rows:
        row["reward_model"] = {"style": "rule"}  # no ground_truth: a rule reward cannot score it
    bad = str(tmp_path / "val.parquet")
    pq.write_table(pa.Table.from_pylist(rows), bad)
    cfg = flow_config(str(tmp_path / "runs"), "heldout", **LIGHT, **{"data.val_files": [bad]})
    run = cli("run", write_config(tmp_path, cfg))
    rc, took = run.finish()
    out = run.text()
    print(f"\n--- a held-out file without ground truth: exit {rc} after {took:.1f} s ---\n{out}")
    assert rc == 1
    block = error_block(out)
    assert block.startswith("ppoflow: the run failed in task preflight (1 attempt, not retried")
    assert (
        f"data.val_files: {bad} column 'reward_model': its type is struct<style: string>, with no "
        "'ground_truth' field (rule rewards read it)" in block
    )
    assert run.started("ppoflow.cli.local_api") and run.started(*RANKS) == []
    assert preflight_seconds(block) < PREFLIGHT_S
