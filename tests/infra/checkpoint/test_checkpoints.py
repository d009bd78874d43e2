"""Checkpoints (ppoflow.infra.checkpoint.sharded, ppoflow.infra.checkpoint.hf_export) on real gloo ranks and in-process.

One module fixture builds the tiny model, saves a 1-process checkpoint ``c1`` after step 1, then
runs torchrun jobs (tests/support/ckpt/ckpt_ranks.py): 2 ranks (save ``c2``; 2->2, 1->2 and
S3 round trips), 4 ranks as a 2x2 HSDP mesh (2->4, save ``c4``), 2 ranks saving in the background
while training goes on (with injected storage failures), and 2 ranks of which one is killed while
it writes. The tests assert on their results and do the 2->1 / 4->1 loads, export, verification
(a flipped byte, a truncated shard, a damaged marker) and failure cases in this process.
Tolerances: same world size bit-exact; across world sizes the gradients are reduced in another
order, so the step after a load is compared to 1e-6.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.checkpoint import sharded as ck
from ppoflow.infra.checkpoint.hf_export import export_hf
from tests.support.ckpt.common import batch, full_params, make_optim, max_diff, train_step
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(ROOT, "tests", "support", "ckpt", "ckpt_ranks.py")
TOL = 1e-6


def torchrun(
    nprocs: int, *args: str, env: dict | None = None, timeout: float = 240, expect_ok: bool = True
) -> float:
    """Run the rank script under torchrun; fail with its output tail (unless ``expect_ok`` is
    False: then it must fail). Returns the wall time."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        "--max-restarts=0",
        SCRIPT,
        *args,
    ]
    full_env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_ok:
        assert proc.returncode == 0, f"torchrun {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    else:
        assert proc.returncode != 0 and "injected fault" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    return time.perf_counter() - t0


def plain_model(work: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(work, "base"))


@pytest.fixture(scope="module")
def run(tmp_path_factory, s3_server):
    """The shared work dir after the in-process c1 save and both torchrun jobs."""
    torch.set_num_threads(1)
    work = str(tmp_path_factory.mktemp("ckpt"))
    save_tiny_model(os.path.join(work, "base"))
    model = plain_model(work)
    opt, sched = make_optim(model)
    train_step(model, opt, sched, 1)
    ck.save_checkpoint(os.path.join(work, "c1"), model, opt, sched, extra={"iteration": 1})
    train_step(model, opt, sched, 2)
    save_file(full_params(model), os.path.join(work, "ref2_1rank.safetensors"))
    s3_url = s3_server["url"] + "/ckpt/ranks2"
    wall = {"save": torchrun(2, "save", work, env={"CKPT_S3_URL": s3_url})}
    wall["hsdp"] = torchrun(4, "hsdp", work)
    wall["async"] = torchrun(2, "async", work)
    wall["killed"] = torchrun(
        2, "killed", work, env={"PPOFLOW_FAULT": "rank_exit:checkpoint_write:1"}, expect_ok=False
    )
    results = {m: json.load(open(os.path.join(work, f"results_{m}.json"))) for m in ("save", "hsdp", "async")}
    print(f"\ncheckpoint timings: torchrun wall {wall}; in-rank {results}")
    return {"work": work, "results": results, "s3_url": s3_url}


def test_two_ranks_round_trip_is_bit_exact(run):
    res = run["results"]["save"]
    assert res["extra_2to2"] == {"iteration": 1, "step": 1}
    assert res["w_2to2"] == 0.0
    assert res["step_2to2"] == 0.0, "the AdamW step after a 2->2 load must equal the uninterrupted step"
    assert res["rng_2to2_restored"], "same world size: each rank's RNG state comes back"
    assert res["lr_after_load"] == pytest.approx(1e-3 * 2 / 3)


def test_one_rank_checkpoint_loads_on_two(run):
    res = run["results"]["save"]
    assert res["w_1to2"] == 0.0
    work = run["work"]
    after = load_file(os.path.join(work, "step2_from_c1.safetensors"))
    diff = max_diff(after, load_file(os.path.join(work, "ref2_1rank.safetensors")))
    print(f"\n1->2: next step vs uninterrupted 1-rank run: max |diff| {diff:.2e}")
    assert diff <= TOL


def test_two_rank_checkpoint_loads_on_one(run, caplog):
    work = run["work"]
    model = plain_model(work)
    opt, sched = make_optim(model)
    torch.manual_seed(123)
    expected_rand = torch.rand(4)
    torch.manual_seed(123)
    with caplog.at_level(logging.WARNING, logger="ppoflow.checkpoint"):
        extra = ck.load_checkpoint(os.path.join(work, "c2"), model, opt, sched)
    assert extra == {"iteration": 1, "step": 1}
    assert "RNG states are not restored" in caplog.text
    assert torch.equal(torch.rand(4), expected_rand), "world size differs: RNG left untouched"
    assert max_diff(full_params(model), load_file(os.path.join(work, "w1.safetensors"))) == 0.0
    train_step(model, opt, sched, 2)
    ref2 = load_file(os.path.join(work, "ref2.safetensors"))
    diff = max_diff(full_params(model), ref2)
    print(f"\n2->1: next step vs uninterrupted 2-rank run: max |diff| {diff:.2e}")
    assert diff <= TOL
    # The tolerance discriminates: without the optimizer state the next step is far off.
    fresh = plain_model(work)
    ck.load_checkpoint(os.path.join(work, "c2"), fresh)
    opt, sched = make_optim(fresh)
    train_step(fresh, opt, sched, 2)
    assert max_diff(full_params(fresh), ref2) > 1e-4


def test_hsdp_two_by_two_mesh(run):
    res = run["results"]["hsdp"]
    assert res["extra_2to4"] == {"iteration": 1, "step": 1}
    assert res["w_2to4"] == 0.0
    assert res["step_2to4"] <= TOL
    # ... and what the 2x2 mesh saved loads into one plain process.
    work = run["work"]
    model = plain_model(work)
    assert ck.load_checkpoint(os.path.join(work, "c4"), model) == {"iteration": 2}
    assert max_diff(full_params(model), load_file(os.path.join(work, "w4.safetensors"))) == 0.0


def test_s3_round_trip_on_ranks_and_with_storage_options(run, s3_server, monkeypatch):
    res = run["results"]["save"]
    assert res["extra_s3"] == {"iteration": 1, "where": "s3"}
    assert res["w_s3"] == 0.0 and res["step_s3"] == 0.0
    assert ck.is_complete(run["s3_url"])
    # Explicit storage options reach DCP's fsspec writer/reader (no AWS_ENDPOINT_URL in the env).
    import s3fs

    monkeypatch.delenv("AWS_ENDPOINT_URL")
    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"endpoint_url": s3_server["endpoint_url"], "key": "testing", "secret": "testing"}
    work = run["work"]
    model = plain_model(work)
    ck.load_checkpoint(os.path.join(work, "c2"), model)
    url = s3_server["url"] + "/ckpt/options"
    ck.save_checkpoint(url, model, extra={"k": 1}, storage_options=opts)
    fresh = plain_model(work)
    assert ck.load_checkpoint(url, fresh, storage_options=opts) == {"k": 1}
    assert max_diff(full_params(fresh), full_params(model)) == 0.0
    s3fs.S3FileSystem.clear_instance_cache()


def test_load_full_state_dict_equals_full_params(run):
    work = run["work"]
    w1 = load_file(os.path.join(work, "w1.safetensors"))
    full = ck.load_full_state_dict(os.path.join(work, "c2"))
    assert set(full) == set(w1) and max_diff(full, w1) == 0.0
    some = ck.load_full_state_dict(os.path.join(work, "c2"), keys=["model.norm.weight", "lm_head.weight"])
    assert set(some) == {"model.norm.weight", "lm_head.weight"}
    with pytest.raises(KeyError, match="Hugging Face names"):
        ck.load_full_state_dict(os.path.join(work, "c2"), keys=["hf.model.norm.weight"])


def test_export_hf_gives_the_same_logits(run, tmp_path):
    from transformers import AutoModelForCausalLM

    work = run["work"]
    out = export_hf(os.path.join(work, "c2"), str(tmp_path / "hf"), os.path.join(work, "base"))
    names = sorted(os.listdir(out))
    assert "model.safetensors" in names and "tokenizer_config.json" in names and "config.json" in names
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors")), "tied: no lm_head"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=batch(9)).logits
    saved = load_file(os.path.join(work, "logits.safetensors"))["logits"]
    assert float((logits - saved).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="does not match the architecture"):
        save_tiny_model(str(tmp_path / "other"), hidden_size=128, num_heads=4)
        export_hf(os.path.join(work, "c2"), str(tmp_path / "bad"), str(tmp_path / "other"))


def test_export_hf_publishes_whole_or_not_at_all(run, tmp_path, monkeypatch):
    """A write that fails half way (disk full on the second shard) leaves no new directory and an
    earlier export untouched; a re-export into it replaces its weights and keeps the user's files."""
    import safetensors.torch

    ckpt, base = os.path.join(run["work"], "c2"), os.path.join(run["work"], "base")
    real_save, calls = safetensors.torch.save_file, []

    def full_disk_on_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second)
    with pytest.raises(OSError, match="No space left"):
        export_hf(ckpt, str(tmp_path / "new"), base, max_shard_bytes=64 * 1024)
    assert sorted(os.listdir(tmp_path)) == [], "nothing of the failed export is left"

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    old = export_hf(ckpt, str(tmp_path / "old"), base, max_shard_bytes=64 * 1024)
    assert oct(os.stat(old).st_mode & 0o777) == "0o755"
    shards = sorted(n for n in os.listdir(old) if n.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(old)
    before = {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)}
    calls.clear()
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second)
    with pytest.raises(OSError, match="No space left"):
        export_hf(ckpt, old, base, max_shard_bytes=64 * 1024)
    assert {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)} == before
    assert sorted(os.listdir(tmp_path)) == ["old"]

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    with open(os.path.join(old, "NOTES.md"), "w") as f:
        f.write("mine")
    export_hf(ckpt, old, base)  # one shard now: the old shards and index go
    names = sorted(os.listdir(old))
    assert "model.safetensors" in names and "NOTES.md" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    exported = load_file(os.path.join(old, "model.safetensors"))
    full = ck.load_full_state_dict(ckpt)
    assert max_diff(exported, {k: full[k] for k in exported}) == 0.0


def test_incomplete_checkpoint_is_refused(run, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(run["work"], "c2"), broken)
    os.remove(os.path.join(broken, ck.MARKER))
    assert not ck.is_complete(broken)
    model = plain_model(run["work"])
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted before publish.*previous iteration"):
        ck.load_checkpoint(broken, model)
    with pytest.raises(ck.IncompleteCheckpointError):
        ck.load_full_state_dict(broken)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_checkpoint(str(tmp_path / "nothing"), model)


def test_in_process_memory_url_wrapper_names_and_overwrite(run):
    """memory:// works; a wrapper's prefix is stripped; a second save to a URL replaces the first."""
    from transformers import PreTrainedModel

    class Wrapper(torch.nn.Module):
        def __init__(self, hf: PreTrainedModel):
            super().__init__()
            self.hf = hf

    work = run["work"]
    wrapped = Wrapper(plain_model(work))
    opt, sched = make_optim(wrapped)
    train_step(wrapped.hf, opt, sched, 1)
    url = "memory://ppoflow-ckpt-test/wrapped"
    ck.save_checkpoint(url, wrapped, opt, sched, extra={"v": 1})
    train_step(wrapped.hf, opt, sched, 2)
    ck.save_checkpoint(url, wrapped, opt, sched, extra={"v": 2})
    full = ck.load_full_state_dict(url)
    assert "model.embed_tokens.weight" in full and not any(k.startswith("hf.") for k in full)
    plain = plain_model(work)
    opt2, sched2 = make_optim(plain)
    assert ck.load_checkpoint(url, plain, opt2, sched2) == {"v": 2}
    assert max_diff(full_params(plain), {k[3:]: v for k, v in full_params(wrapped).items()}) == 0.0
    train_step(wrapped.hf, opt, sched, 3)
    train_step(plain, opt2, sched2, 3)
    assert max_diff(full_params(plain), {k[3:]: v for k, v in full_params(wrapped).items()}) == 0.0


def test_bad_inputs_fail_clearly(run, tmp_path):
    work = run["work"]
    model = plain_model(work)
    with pytest.raises(ck.CheckpointError, match="cannot be stored as JSON"):
        ck.save_checkpoint(str(tmp_path / "x"), model, extra={"t": torch.zeros(1)})
    assert not ck.is_complete(str(tmp_path / "x"))
    ck.save_checkpoint(str(tmp_path / "model_only"), model)
    opt, _ = make_optim(model)
    with pytest.raises(ck.CheckpointError, match="no optimizer state"):
        ck.load_checkpoint(str(tmp_path / "model_only"), model, opt)
    from ppoflow.demo.tiny_models import save_tiny_model as stm

    stm(str(tmp_path / "bigger"), hidden_size=128, num_heads=4)
    from transformers import AutoModelForCausalLM

    with pytest.raises(ck.CheckpointError, match="failed"):
        ck.load_checkpoint(
            str(tmp_path / "model_only"), AutoModelForCausalLM.from_pretrained(str(tmp_path / "bigger"))
        )


def test_never_stepped_optimizer_stays_fresh(run, tmp_path):
    """DCP initialises an empty optimizer state with a zero-grad step; the save and the load undo
    it, so a checkpoint taken before the first step resumes exactly like an uninterrupted run."""
    work = run["work"]
    model = plain_model(work)
    opt, sched = make_optim(model)
    ck.save_checkpoint(str(tmp_path / "fresh"), model, opt, sched)
    assert not opt.state
    train_step(model, opt, sched, 1)
    restored = plain_model(work)
    opt2, sched2 = make_optim(restored)
    ck.load_checkpoint(str(tmp_path / "fresh"), restored, opt2, sched2)
    assert not opt2.state
    train_step(restored, opt2, sched2, 1)
    assert max_diff(full_params(restored), full_params(model)) == 0.0


# ----------------------------------------------------------------------------- background saves
def test_background_save_is_the_state_at_staging_while_training_goes_on(run):
    res = run["results"]["async"]
    assert res["after_step2_while_writing"] == 0.0, "training during the write is unaffected"
    assert res["extra_a"] == {"step": 1}
    assert res["w_a"] == 0.0, "the checkpoint holds the weights of the moment it was staged"
    assert res["step_a"] == 0.0, "resuming from it is bit-exact"
    work = run["work"]
    assert ck.verify_checkpoint(os.path.join(work, "ca"))["verified"]
    for name in ("cb", "cc"):  # written by two threads per rank: two files each
        marker = ck.verify_checkpoint(os.path.join(work, name))
        assert marker["verified"] and marker["extra"] == {"k": name[1]}
        assert {"optim/__0_0.distcp", "optim/__0_1.distcp", "optim/__1_1.distcp"} <= set(marker["files"])
    fresh = plain_model(work)
    ck.load_checkpoint(os.path.join(work, "cc"), fresh)
    assert max_diff(full_params(fresh), load_file(os.path.join(work, "ref2.safetensors"))) == 0.0


def test_failed_background_writes_are_retried_then_reported_never_published(run):
    from ppoflow.infra.checkpoint.marker import read_failure

    res, work = run["results"]["async"], run["work"]
    assert res["retried_ok"] and ck.verify_checkpoint(os.path.join(work, "cd"))["verified"]
    assert res["failed_raised"]
    failed = os.path.join(work, "ce")
    assert not ck.is_complete(failed)
    assert "injected fault" in read_failure(failed)
    with pytest.raises(ck.IncompleteCheckpointError, match="its write failed.*injected fault"):
        ck.load_checkpoint(failed, plain_model(work))
    # rank 0 could not publish the marker: both ranks' waits raised (none was left in a collective),
    # and the checkpoint is incomplete, with the reason recorded
    assert res["publish_failed_raised"]
    unpublished = os.path.join(work, "cf")
    assert not ck.is_complete(unpublished) and "publishing" in read_failure(unpublished)


def test_a_rank_killed_while_writing_leaves_an_incomplete_checkpoint(run):
    killed = os.path.join(run["work"], "ck")
    assert os.path.isdir(killed) and not ck.is_complete(killed)
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted before publish"):
        ck.load_checkpoint(killed, plain_model(run["work"]))


# ----------------------------------------------------------------------------- verification
def _biggest_item(checkpoint: str, sub: str, shard: str):
    """(offset, length) of the largest tensor record in ``sub/shard`` (from DCP's metadata), not
    counting the tied embedding (its twin ``lm_head`` would overwrite a change on load)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(os.path.join(checkpoint, sub)).read_metadata()
    items = [
        info
        for index, info in meta.storage_data.items()
        if info.relative_path == shard and "embed_tokens" not in index.fqn and "lm_head" not in index.fqn
    ]
    best = max(items, key=lambda info: info.length)
    return best.offset, best.length


def test_a_flipped_byte_in_tensor_data_is_caught_and_named(run, tmp_path):
    work = run["work"]
    bad = str(tmp_path / "flipped")
    shutil.copytree(os.path.join(work, "c2"), bad)
    offset, length = _biggest_item(bad, "model", "__0_0.distcp")
    path = os.path.join(bad, "model", "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0x01]))
    match = r"(?s)model/__0_0\.distcp: content differs from the recorded hash.*ppoflow rollback"
    with pytest.raises(ck.CorruptCheckpointError, match=match):
        ck.verify_checkpoint(bad)
    with pytest.raises(ck.CorruptCheckpointError, match=match):
        ck.load_checkpoint(bad, plain_model(work))
    with pytest.raises(ck.CorruptCheckpointError, match=match):
        ck.load_full_state_dict(bad)
    # The byte is tensor data: unverified, the load "succeeds" with other weights.
    unverified = plain_model(work)
    ck.load_checkpoint(bad, unverified, verify=False)
    assert max_diff(full_params(unverified), load_file(os.path.join(work, "w1.safetensors"))) > 0.0


def test_a_truncated_shard_and_a_damaged_marker_are_caught(run, tmp_path):
    work = run["work"]
    bad = str(tmp_path / "truncated")
    shutil.copytree(os.path.join(work, "c2"), bad)
    path = os.path.join(bad, "optim", "__1_0.distcp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    model = plain_model(work)
    opt, sched = make_optim(model)
    with pytest.raises(
        ck.CorruptCheckpointError,
        match=rf"optim/__1_0\.distcp: {size - 100} bytes, the marker recorded {size}",
    ):
        ck.load_checkpoint(bad, model, opt, sched)
    # a weights-only read does not need the optimizer's files
    assert set(ck.load_full_state_dict(bad)) == set(load_file(os.path.join(work, "w1.safetensors")))
    marker = os.path.join(bad, ck.MARKER)
    data = json.load(open(marker))
    data["extra"]["iteration"] = 7
    with open(marker, "w") as f:
        json.dump(data, f)
    with pytest.raises(ck.CorruptCheckpointError, match="does not match its own recorded hash"):
        ck.read_marker(bad)


def test_verification_cost(run, tmp_path):
    """Prints the hash throughput (the cost of verifying a checkpoint, per byte read)."""
    from ppoflow.infra.data.hashing import hash_bytes

    data = os.urandom(64 << 20)
    t0 = time.perf_counter()
    hash_bytes(data)
    gbs = len(data) / (time.perf_counter() - t0) / 1e9
    c2 = os.path.join(run["work"], "c2")
    t0 = time.perf_counter()
    marker = ck.verify_checkpoint(c2)
    dt = time.perf_counter() - t0
    total = sum(f["size"] for f in marker["files"].values())
    print(
        f"\nxxh3_64: {gbs:.2f} GB/s in memory; verify_checkpoint of {total / 1e6:.1f} MB: {dt * 1e3:.1f} ms"
    )
    assert gbs > 0.2


def test_a_paused_writer_holds_its_background_write_until_the_block_ends(run, tmp_path):
    """CheckpointWriter.paused() (held around the weight push into vLLM): the write thread stops at
    its first byte and waits while the block runs; afterwards the checkpoint is written whole."""
    from ppoflow.infra.checkpoint.marker import is_complete
    from ppoflow.infra.checkpoint.writer import CheckpointWriter

    work = run["work"]
    model = plain_model(work)
    opt, sched = make_optim(model)
    train_step(model, opt, sched, 1)
    want = full_params(model)
    url = str(tmp_path / "paused")
    writer = CheckpointWriter()

    def written() -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(url) for f in fs)

    try:
        with writer.paused():
            with writer.paused():  # nested: the outer block still holds the write
                writer.save(url, model, opt, sched, extra={"k": "p"}, background=True)
            time.sleep(1.0)
            assert written() == 0 and not is_complete(url), "the write went on while paused"
            assert writer.pending == url
        result = writer.wait()
    finally:
        writer.close()
    assert result["bytes"] > 0 and is_complete(url)
    assert ck.verify_checkpoint(url)["extra"] == {"k": "p"}
    fresh = plain_model(work)
    ck.load_checkpoint(url, fresh)
    assert max_diff(full_params(fresh), want) == 0.0
