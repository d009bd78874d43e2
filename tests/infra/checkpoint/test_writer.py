"""Checkpoint writes (ppoflow.infra.checkpoint.writer): a background save holds the state at staging
while training goes on, failed writes are retried then reported and never published, a rank
killed while writing leaves an incomplete checkpoint, a paused writer waits."""

from __future__ import annotations

import os
import time

import pytest
from safetensors.torch import load_file

from ppoflow.infra.checkpoint import sharded as ck
from tests.support.ckpt.checkpoint_run import plain_model
from tests.support.ckpt.common import full_params, make_optim, max_diff, train_step

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- background saves
def test_background_save_is_the_state_at_staging_while_training_goes_on(ckpt_run):
    res = ckpt_run["results"]["async"]
    assert res["after_step2_while_writing"] == 0.0, "training during the write is unaffected"
    assert res["extra_a"] == {"step": 1}
    assert res["w_a"] == 0.0, "the checkpoint holds the weights of the moment it was staged"
    assert res["step_a"] == 0.0, "resuming from it is bit-exact"
    work = ckpt_run["work"]
    assert ck.verify_checkpoint(os.path.join(work, "ca"))["verified"]
    for name in ("cb", "cc"):  # written by two threads per rank: two files each
        marker = ck.verify_checkpoint(os.path.join(work, name))
        assert marker["verified"] and marker["extra"] == {"k": name[1]}
        assert {"optim/__0_0.distcp", "optim/__0_1.distcp", "optim/__1_1.distcp"} <= set(marker["files"])
    fresh = plain_model(work)
    ck.load_checkpoint(os.path.join(work, "cc"), fresh)
    assert max_diff(full_params(fresh), load_file(os.path.join(work, "ref2.safetensors"))) == 0.0


def test_failed_background_writes_are_retried_then_reported_never_published(ckpt_run):
    from ppoflow.infra.checkpoint.marker import read_failure

    res, work = ckpt_run["results"]["async"], ckpt_run["work"]
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


def test_a_rank_killed_while_writing_leaves_an_incomplete_checkpoint(ckpt_run):
    killed = os.path.join(ckpt_run["work"], "ck")
    assert os.path.isdir(killed) and not ck.is_complete(killed)
    with pytest.raises(ck.IncompleteCheckpointError, match="interrupted before publish"):
        ck.load_checkpoint(killed, plain_model(ckpt_run["work"]))


def test_a_paused_writer_holds_its_background_write_until_the_block_ends(ckpt_run, tmp_path):
    """CheckpointWriter.paused() (held around the weight push into vLLM): the write thread stops at
    its first byte and waits while the block runs; afterwards the checkpoint is written whole."""
    from ppoflow.infra.checkpoint.marker import is_complete
    from ppoflow.infra.checkpoint.writer import CheckpointWriter

    work = ckpt_run["work"]
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
