"""The publish marker (ppoflow.infra.checkpoint.marker): a checkpoint without one is refused, and
verification against it names a flipped byte, a truncated shard and a damaged marker."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from safetensors.torch import load_file

from ppoflow.infra.checkpoint import sharded as ck
from ppoflow.workers.rollout.weight_sync import checkpoint_weights
from tests.support.ckpt.checkpoint_run import plain_model
from tests.support.ckpt.common import full_params, make_optim, max_diff

pytestmark = pytest.mark.slow


def test_incomplete_checkpoint_is_refused(ckpt_run, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(ckpt_run["work"], "c2"), broken)
    os.remove(os.path.join(broken, ck.MARKER))
    assert not ck.is_complete(broken)
    model = plain_model(ckpt_run["work"])
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted before publish.*previous iteration"):
        ck.load_checkpoint(broken, model)
    with pytest.raises(ck.IncompleteCheckpointError):
        ck.load_full_state_dict(broken)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ck.load_checkpoint(str(tmp_path / "nothing"), model)


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


def test_a_flipped_byte_in_tensor_data_is_caught_and_named(ckpt_run, tmp_path):
    work = ckpt_run["work"]
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
    names = list(load_file(os.path.join(work, "w1.safetensors")))
    with pytest.raises(ck.CorruptCheckpointError, match=match):  # an engine's push from a checkpoint
        next(checkpoint_weights(bad, names))
    assert len(list(checkpoint_weights(bad, names, verify=False))) == len(names)  # checkpoint.verify: false
    # The byte is tensor data: unverified, the load "succeeds" with other weights.
    unverified = plain_model(work)
    ck.load_checkpoint(bad, unverified, verify=False)
    assert max_diff(full_params(unverified), load_file(os.path.join(work, "w1.safetensors"))) > 0.0


def test_a_truncated_shard_and_a_damaged_marker_are_caught(ckpt_run, tmp_path):
    work = ckpt_run["work"]
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


def test_verification_cost(ckpt_run, tmp_path):
    """Prints the hash throughput (the cost of verifying a checkpoint, per byte read)."""
    from ppoflow.infra.data.hashing import hash_bytes

    data = os.urandom(64 << 20)
    t0 = time.perf_counter()
    hash_bytes(data)
    gbs = len(data) / (time.perf_counter() - t0) / 1e9
    c2 = os.path.join(ckpt_run["work"], "c2")
    t0 = time.perf_counter()
    marker = ck.verify_checkpoint(c2)
    dt = time.perf_counter() - t0
    total = sum(f["size"] for f in marker["files"].values())
    print(
        f"\nxxh3_64: {gbs:.2f} GB/s in memory; verify_checkpoint of {total / 1e6:.1f} MB: {dt * 1e3:.1f} ms"
    )
    assert gbs > 0.2
