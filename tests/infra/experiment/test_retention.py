"""Retention (ppoflow.infra.experiment.retention) and the CLI over it and rollback (``ppoflow
rollback``, the sizes in ``ppoflow status``) on synthetic experiments (tests/support/fake_experiments.py),
so every case runs in milliseconds. The expected sets come from a plain loop over the documented
rule, not from the code under test.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from ppoflow.infra.checkpoint.marker import is_complete, read_marker
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from ppoflow.infra.experiment.retention import apply_retention, checkpoint_sizes
from tests.support.fake_experiments import ROLES, fake_experiment


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
