"""ppoflow.infra.experiment.paths: every URL of an experiment is joined inside its root — neither a
config built around validation nor a stored reference with ``..`` resolves outside it."""

from __future__ import annotations

import pytest

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.paths import ExperimentPaths


def _cfg(root: str) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "model": {"path": "/models/tiny"},
            "data": {"train_files": ["x.parquet"]},
            "storage": {"root": root, "experiment": "exp"},
        }
    )


def test_experiment_paths_never_resolve_outside_the_root_or_the_experiment(tmp_path):
    from ppoflow.infra.experiment.paths import OutsideExperiment

    cfg = _cfg(str(tmp_path / "runs"))
    paths = ExperimentPaths.of(cfg)
    assert paths.root == f"{tmp_path}/runs/exp"
    assert paths.url("checkpoints/actor/000001") == f"{paths.root}/checkpoints/actor/000001"
    # a config built around validation (model_copy does not validate) still cannot leave the root
    for bad in ("../escape", "..", "a/b"):
        sneaky = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"experiment": bad})})
        with pytest.raises(OutsideExperiment, match=rf"storage.experiment={bad!r}"):
            ExperimentPaths.of(sneaky)
    # a stored reference with '..' (not one ppoflow wrote) is refused, not followed
    for ref in ("../other/checkpoints/actor/000001", "checkpoints/../../x", "./manifest.json"):
        with pytest.raises(OutsideExperiment, match="would leave"):
            paths.url(ref)
    with pytest.raises(OutsideExperiment):
        paths.file(1, "eval/../../../x")
    assert storage.join_inside("s3://b/root", "exp", "/a") == "s3://b/root/exp/a"
    with pytest.raises(ValueError, match=r"'\.\./x' would leave s3://b/root"):
        storage.join_inside("s3://b/root", "../x")
