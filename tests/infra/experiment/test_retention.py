"""Retention (ppoflow.infra.experiment.retention), rollback (ppoflow.infra.experiment.rollback) and
their CLI (``ppoflow rollback``, the sizes in ``ppoflow status``) on synthetic experiments: real
manifests and real checkpoint markers (every file's size and xxh3 hash) over small files, so every
case runs in milliseconds. The expected sets come from a plain loop over the documented rule, not
from the code under test. The rollback of a real run is in tests/scenarios/test_flow_checkpoints.py.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from ppoflow.infra.checkpoint.integrity import ALGORITHM, hash_bytes
from ppoflow.infra.checkpoint.marker import FORMAT, is_complete, read_marker, write_marker
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest, read_manifest
from ppoflow.infra.experiment.retention import apply_retention, checkpoint_sizes
from ppoflow.infra.experiment.rollback import RollbackRefused, rollback

ROLES = ("actor", "critic")


def fake_checkpoint(url: str, seed: int, optimizer: bool = True) -> None:
    """A published checkpoint with a model and (optionally) an optimizer file, as the writer lays
    them out (the files are random bytes; only sizes and hashes matter here)."""
    files = {"model/__0_0.distcp": os.urandom(1000 + seed), "rng/rank_00000.json": b'{"seed": %d}' % seed}
    if optimizer:
        files["optim/__0_0.distcp"] = os.urandom(2000 + seed)
    for name, data in files.items():
        storage.write_bytes_atomic(storage.join(url, name), data)
    write_marker(
        url,
        {
            "format": FORMAT,
            "world_size": 1,
            "layout": {"model": "model", "optim": "optim" if optimizer else None},
            "optimizer": {"param_groups": [], "scalars": {}, "fresh": False},
            "lr_scheduler": None,
            "extra": {"seed": seed},
            "files": {k: {"size": len(v), ALGORITHM: hash_bytes(v)} for k, v in files.items()},
        },
    )


def fake_experiment(root: str, n: int, one_step: bool, extra_dirs: int = 1) -> ExperimentPaths:
    """Manifests 0..n (root at n), checkpoints 0..n+extra_dirs (the later ones: an iteration being
    written), a receipt and a data file per iteration."""
    paths = ExperimentPaths(os.path.join(root, "exp"))
    for k in range(n + 1 + extra_dirs):
        for role in ROLES:
            fake_checkpoint(paths.checkpoint(role, k), seed=k)
        storage.write_bytes_atomic(paths.file(k, "rollout.arrow"), b"data")
        storage.write_json_atomic(paths.receipt(k, "generate"), {"task": "generate", "iteration": k})
    for k in range(n + 1):
        rollout = (
            {role: paths.ref(paths.checkpoint(role, max(k - 1, 0))) for role in ROLES}
            if one_step and k
            else None
        )
        manifest = Manifest(
            experiment="exp",
            iteration=k,
            actor_checkpoint=paths.ref(paths.checkpoint("actor", k)),
            critic_checkpoint=paths.ref(paths.checkpoint("critic", k)),
            config_hash="h",
            identity={},
            data_cursor={"epoch": 0, "offset": 4 * k},
            kl_coef=None,
            created_at="t",
            committed_at="t",
            rollout_checkpoints=rollout,
        )
        storage.write_json_atomic(paths.file(k, "manifest.json"), manifest.to_json())
    storage.write_json_atomic(paths.manifest, manifest.to_json())
    return paths


def expected(n: int, keep_last: int | None, keep_every: int, slim: bool, one_step: bool):
    """(iterations whose checkpoints stay, of those: the weights-only ones) by the README's rule."""
    last = {k for k in range(n + 1) if keep_last is None or k > n - keep_last}
    every = {k for k in range(n + 1) if keep_every and k % keep_every == 0}
    whole: set[int] = set()
    for k in last:
        whole |= {k, max(k - 1, 0)} if one_step else {k}
    stay = set(whole)
    for k in every - last:
        stay |= {k} if slim else ({k, max(k - 1, 0)} if one_step else {k})
    weights_only = {k for k in every - whole} if slim else set()
    return stay, weights_only


def on_storage(paths: ExperimentPaths, role: str) -> set[int]:
    return {int(name) for name in storage.listdir(storage.join(paths.root, "checkpoints", role))}


@pytest.mark.parametrize(
    "n,keep_last,keep_every,slim,one_step",
    [
        (10, 3, 4, True, True),
        (10, 3, 4, False, True),
        (10, 3, 0, True, False),
        (10, 1, 0, True, True),
        (7, 2, 3, True, False),
        (5, None, 0, True, True),
        (3, 5, 2, True, False),
    ],
)
def test_retention_keeps_exactly_what_kept_manifests_reference(
    tmp_path, n, keep_last, keep_every, slim, one_step
):
    paths = fake_experiment(str(tmp_path), n, one_step)
    policy = SimpleNamespace(keep_last=keep_last, keep_every=keep_every, keep_every_weights_only=slim)
    removed = apply_retention(paths, policy, read_manifest(paths))
    stay, weights_only = expected(n, keep_last, keep_every, slim, one_step)
    for role in ROLES:
        assert on_storage(paths, role) == stay | {n + 1}, (
            f"{role}: the in-flight iteration {n + 1} is never touched"
        )
        for k in stay:
            marker = read_marker(paths.checkpoint(role, k))
            assert (marker["layout"]["optim"] is None) == (k in weights_only), (role, k)
            assert (
                not os.path.exists(os.path.join(paths.checkpoint(role, k), "optim")) or k not in weights_only
            )
    assert sorted(removed) == sorted(
        paths.checkpoint(role, k) for role in ROLES for k in range(n + 1) if k not in stay
    )
    # every checkpoint the current manifest needs is still complete; data files are not retention's
    for ref in read_manifest(paths).checkpoints():
        assert is_complete(paths.url(ref))
    assert all(storage.exists(paths.file(k, "rollout.arrow")) for k in range(n + 1))
    # a second pass removes nothing
    assert apply_retention(paths, policy, read_manifest(paths)) == []


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


def test_cli_status_lists_checkpoint_sizes_and_rollback_reports(tmp_path, capsys):
    from ppoflow.cli.main import main

    paths = fake_experiment(str(tmp_path), 4, one_step=False, extra_dirs=0)
    apply_retention(
        paths, SimpleNamespace(keep_last=2, keep_every=2, keep_every_weights_only=True), read_manifest(paths)
    )
    assert main(["status", paths.root]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    sizes = {row["iteration"]: row for row in checkpoint_sizes(paths, 4) if row["role"] == "actor"}
    assert set(sizes) == {0, 2, 3, 4}
    assert "weights only" in rows["0"] and "weights only" in rows["2"] and "weights only" not in rows["4"]
    assert f"{sizes[4]['bytes'] / 1e6:.1f} MB" in rows["4"]
    as_json = json.loads(main(["status", paths.root, "--json"]) == 0 and capsys.readouterr().out)
    assert {(r["iteration"], r["role"]) for r in as_json["checkpoints"]} == {
        (k, r) for k in (0, 2, 3, 4) for r in ROLES
    }

    assert main(["rollback", paths.root, "--to", "2"]) == 1
    assert "keeps the model weights only" in capsys.readouterr().err
    assert main(["rollback", paths.root, "--to", "3"]) == 0
    assert "now at iteration 3 (was 4)" in capsys.readouterr().out
    assert read_manifest(paths).iteration == 3
