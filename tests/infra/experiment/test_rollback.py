"""Rolling an experiment back (ppoflow.infra.experiment.rollback) on a synthetic experiment: the target is verified first, a refusal changes nothing, and the later iterations' receipts go. The rollback of a real run is in tests/scenarios/test_flow_checkpoints.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import read_manifest
from ppoflow.infra.experiment.retention import apply_retention
from ppoflow.infra.experiment.rollback import RollbackRefused, rollback
from tests.support.fake_experiments import fake_experiment


def test_rollback_verifies_then_moves_the_root_and_forgets_later_receipts(tmp_path):
    paths = fake_experiment(str(tmp_path), 10, one_step=True)
    policy = SimpleNamespace(keep_last=3, keep_every=4, keep_every_weights_only=True)
    apply_retention(paths, policy, read_manifest(paths))
    before = storage.read_bytes(paths.manifest)

    def refused(to: int, match: str) -> None:
        with pytest.raises(RollbackRefused, match=match):
            rollback(paths, to)
        assert storage.read_bytes(paths.manifest) == before, "a refused rollback changes nothing"
        assert storage.exists(paths.receipt(10, "generate"))

    refused(11, "the last committed iteration is 10")
    refused(
        4,
        r"keeps the model weights only.*Iterations whose checkpoints are kept with optimizer state: 7, 8, 9, 10",
    )
    refused(2, r"checkpoints/actor/000002 is not usable \(no checkpoint at")
    # a flipped byte in a file of iteration 7's actor checkpoint (manifest 8's next rollout uses it)
    shard = os.path.join(paths.checkpoint("actor", 7), "model", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[500] ^= 0x10
    open(shard, "wb").write(bytes(data))
    refused(8, r"(?s)checkpoints/actor/000007 is not usable.*model/__0_0\.distcp: content differs")

    target = rollback(paths, 9)
    assert target.iteration == 9 and read_manifest(paths).to_json() == storage.read_json(
        paths.file(9, "manifest.json")
    )
    assert not storage.exists(paths.receipt(10, "generate")), "the abandoned iteration's receipts are gone"
    assert storage.exists(paths.receipt(9, "generate")) and storage.exists(paths.file(10, "rollout.arrow"))
    assert is_complete(paths.checkpoint("actor", 10)), "later checkpoints stay until replaced or retired"
