"""ppoflow.infra.experiment.manifest: the manifest's publish protocol, identity checks and format."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import (
    ExperimentPaths,
    IdentityMismatch,
    Manifest,
    ManifestConflict,
    check_identity,
    initial_manifest,
    next_manifest,
    publish,
    read_manifest,
)


def _cfg(root: str, **over) -> ExperimentConfig:
    data = {
        "model": {"path": "/models/tiny"},
        "data": {"train_files": ["x.parquet"]},
        "storage": {"root": root, "experiment": "exp"},
    }
    for key, value in over.items():
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return ExperimentConfig.model_validate(data)


def test_manifest_publish_and_advance(tmp_path):
    cfg = _cfg(str(tmp_path))
    paths = ExperimentPaths.of(cfg)
    assert read_manifest(paths) is None
    m0 = initial_manifest(cfg, paths, paths.checkpoint("actor", 0), paths.checkpoint("critic", 0), 0.001)
    publish(paths, m0)
    assert read_manifest(paths) == m0
    assert storage.exists(paths.file(0, "manifest.json"))
    assert storage.exists(paths.config(cfg.config_hash()))

    cfg2 = _cfg(str(tmp_path), **{"actor.optim.lr": 3e-6})  # allowed change: recorded
    m1 = next_manifest(
        m0,
        cfg2,
        paths,
        actor_checkpoint=paths.checkpoint("actor", 1),
        critic_checkpoint=paths.checkpoint("critic", 1),
        data_cursor={"epoch": 0, "offset": 16},
        kl_coef=0.001,
        metrics={"critic/score/mean": 0.5, "other": 1.0},
    )
    publish(paths, m1)
    got = read_manifest(paths)
    assert got.iteration == 1 and got.data_cursor == {"epoch": 0, "offset": 16}
    assert [h["iteration"] for h in got.config_history] == [0, 1]
    assert got.config_hash == cfg2.config_hash() != cfg.config_hash()
    assert got.trend == [{"iteration": 1, "critic/score/mean": 0.5}]
    publish(paths, m1)  # a retried commit of the same iteration is a no-op
    with pytest.raises(ManifestConflict, match="expected the manifest at iteration 2, found iteration 1"):
        publish(paths, m0.__class__(**{**m1.to_json(), "iteration": 3}))
    # rollback = copy the per-iteration manifest over the root one
    storage.write_bytes_atomic(paths.manifest, storage.read_bytes(paths.file(0, "manifest.json")))
    assert read_manifest(paths).iteration == 0


@pytest.mark.parametrize(
    "key,value",
    [
        ("model.path", "/models/other"),
        ("model.tokenizer_path", "/tok/other"),
        ("critic.model", {"path": "/models/critic"}),
    ],
)
def test_identity_change_is_refused_with_the_fix(tmp_path, key, value):
    cfg = _cfg(str(tmp_path))
    paths = ExperimentPaths.of(cfg)
    m0 = initial_manifest(cfg, paths, "a", "c", None)
    check_identity(m0, _cfg(str(tmp_path), **{"rollout.n": 4}))  # not identity: fine
    with pytest.raises(IdentityMismatch) as err:
        check_identity(m0, _cfg(str(tmp_path), **{key: value}))
    msg = str(err.value)
    named = {
        "model.path": "model.path",
        "model.tokenizer_path": "model.tokenizer",
        "critic.model": "critic.model",
    }[key]
    assert f"with {named}=" in msg and "storage.experiment" in msg  # the field, the fix
    assert "/models/tiny" in msg  # the old value


def test_manifest_rejects_unknown_format(tmp_path):
    with pytest.raises(ManifestConflict, match="format"):
        Manifest.from_json({"format": 99})


def _entry(n: int, snapshot: bool = False) -> dict:
    entry = {
        "iteration": n,
        "state": f"checkpoints/actor/{n:06d}",
        "previous": f"checkpoints/actor/{n - 1:06d}",
        "batch": f"iterations/{n:06d}/advantages.arrow",
        "bytes": 1,
        "xxh3": "0",
    }
    return {**entry, "snapshot": True} if snapshot else entry


def test_a_deferred_snapshot_is_kept_and_starts_the_chain_once_written(tmp_path):
    """Snapshot 3 was still being written when iterations 3 and 4 committed: the chain replays from
    snapshot 0, retention keeps both snapshots; once 3 is written the chain starts after it."""
    cfg = _cfg(str(tmp_path))
    paths = ExperimentPaths.of(cfg)
    m0 = initial_manifest(cfg, paths, paths.checkpoint("actor", 0), None, None)
    chain = [_entry(1), _entry(2), _entry(3, snapshot=True), _entry(4)]
    m4 = Manifest(
        **{**m0.to_json(), "iteration": 4, "actor_checkpoint": chain[-1]["state"], "replay": {"actor": chain}}
    )
    assert m4.snapshot("actor") == "checkpoints/actor/000000"
    assert m4.checkpoints() == ["checkpoints/actor/000000", "checkpoints/actor/000003"]

    written: set[str] = set()
    assert m4.settled(written.__contains__) == m4  # not written yet: nothing changes
    written.add("checkpoints/actor/000003")
    settled = m4.settled(written.__contains__)
    assert settled.replay == {"actor": [_entry(4)]}
    assert settled.snapshot("actor") == "checkpoints/actor/000003"
    assert settled.checkpoints() == ["checkpoints/actor/000003"]
    # the state itself a written deferred snapshot: no chain left
    m3 = Manifest(**{**m4.to_json(), "iteration": 3, "replay": {"actor": chain[:3]}})
    assert m3.settled(written.__contains__).replay == {}
