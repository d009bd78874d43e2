"""A committed iteration's policy as a Hugging Face directory: what a promotion publishes (the
``ppo-retrain`` flow's and ``ppoflow promote``'s)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

from ppoflow.infra.checkpoint.hf_export import export_hf
from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

__all__ = ["export_iteration"]


def export_iteration(
    cfg: ExperimentConfig,
    paths: ExperimentPaths,
    n: int,
    out_dir: str,
    say: Callable[[str], None] = print,
) -> str:
    """Write the actor of committed iteration ``n`` of the experiment at ``paths`` (``cfg``: its
    config) as a Hugging Face directory at local ``out_dir`` (a state that is not a snapshot is
    rebuilt by replay first, under ``<experiment>/scratch/``, removed after). A
    :class:`ConfigError` when ``n`` is not committed or the base model is not a local directory."""
    manifest = read_manifest(paths)
    if manifest is None or n > manifest.iteration or n < 0:
        last = None if manifest is None else manifest.iteration
        raise ConfigError(f"iteration {n} is not committed (the last committed iteration is {last})")
    source = (
        manifest.to_json() if n == manifest.iteration else storage.read_json(paths.file(n, "manifest.json"))
    )
    checkpoint = paths.url(source["actor_checkpoint"])
    base = manifest.identity.get("model.path")
    if not base or not os.path.isdir(base):
        raise ConfigError(
            f"the experiment's base model {base!r} is not a local directory; export copies config and tokenizer from it"
        )
    scratch = None
    try:
        if not is_complete(checkpoint):
            from ppoflow.tasks.run.materialize import materialize_state

            scratch = storage.join(paths.root, "scratch", f"promote-{uuid.uuid4().hex[:12]}")
            checkpoint = materialize_state(cfg, "actor", checkpoint, storage.join(scratch, "actor"), say=say)
        return export_hf(checkpoint, out_dir, base, tokenizer_path=manifest.identity.get("model.tokenizer"))
    finally:
        if scratch is not None and storage.exists(scratch):
            storage.rm(scratch, recursive=True)
