"""Synthetic experiments on storage: real manifests and real checkpoint markers (every file's size
and hash) over small random files, for the retention and rollback tests."""

from __future__ import annotations

import os

from ppoflow.infra.checkpoint.marker import FORMAT, write_marker
from ppoflow.infra.data import storage
from ppoflow.infra.data.hashing import ALGORITHM, hash_bytes
from ppoflow.infra.experiment.manifest import ExperimentPaths, Manifest

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
