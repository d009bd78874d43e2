"""Comparing and copying experiments on storage, shared by the flow tests."""

from __future__ import annotations

import os
import shutil

import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict, save_checkpoint
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, initial_manifest, next_manifest, publish
from ppoflow.infra.experiment.metrics import is_timing_key


def copy_experiment(src_url: str, dst_root: str, name: str, at: int | None = None) -> str:
    """Copy an experiment directory; with ``at`` roll the copy back to manifest ``at`` (what an
    experiment looks like when iteration ``at + 1`` never happened). Returns the new URL."""
    dst = os.path.join(dst_root, name)
    shutil.copytree(src_url, dst)
    if at is not None:
        for sub in ("iterations", "checkpoints/actor", "checkpoints/critic"):
            if not os.path.isdir(os.path.join(dst, sub)):  # no critic
                continue
            for entry in os.listdir(os.path.join(dst, sub)):
                if int(entry) > at:
                    shutil.rmtree(os.path.join(dst, sub, entry))
        shutil.copy(
            os.path.join(dst, "iterations", f"{at:06d}", "manifest.json"), os.path.join(dst, "manifest.json")
        )
    return dst


def comparable_metrics(url: str, n: int) -> dict:
    """metrics.json of iteration ``n`` without the timings (they differ between runs)."""
    metrics = storage.read_json(ExperimentPaths(url).file(n, "metrics.json"))
    return {k: v for k, v in metrics.items() if not is_timing_key(k)}


def rng_states(checkpoint_url: str) -> dict:
    """The per-rank RNG states a checkpoint saved (``rng/rank_*.json``)."""
    rng = storage.join(checkpoint_url, "rng")
    return {name: storage.read_json(storage.join(rng, name)) for name in storage.listdir(rng)}


def assert_same_commit(url_a: str, url_b: str, n: int, roles: tuple[str, ...] = ("actor", "critic")) -> None:
    """Iteration ``n`` of two experiments: equal checkpoints of ``roles`` (every tensor bit for
    bit, and each rank's RNG state, which decides what later iterations sample), metrics (timings
    excluded), data cursor and KL coefficient."""
    pa_, pb = ExperimentPaths(url_a), ExperimentPaths(url_b)
    ma, mb = (storage.read_json(p.file(n, "manifest.json")) for p in (pa_, pb))
    assert ma["data_cursor"] == mb["data_cursor"] and ma["kl_coef"] == mb["kl_coef"]
    assert ma["actor_checkpoint"] == mb["actor_checkpoint"] == f"checkpoints/actor/{n:06d}"
    for role in roles:
        a = load_full_state_dict(pa_.checkpoint(role, n))
        b = load_full_state_dict(pb.checkpoint(role, n))
        assert a.keys() == b.keys()
        diff = [k for k in a if not torch.equal(a[k], b[k])]
        assert not diff, f"{role} checkpoint {n} differs in {diff[:5]}"
    assert comparable_metrics(url_a, n) == comparable_metrics(url_b, n)
    for role in roles:
        assert rng_states(pa_.checkpoint(role, n)) == rng_states(pb.checkpoint(role, n)), (
            f"the {role} checkpoint {n} holds other RNG states: later iterations would sample differently"
        )


def commit_tiny_iterations(cfg, last: int = 1) -> ExperimentPaths:
    """Iterations 0..``last`` committed the way the flow commits them (a tiny actor checkpoint each,
    real manifests, 4 prompts per step; no critic), without running the flow."""
    paths = ExperimentPaths.of(cfg)
    model = torch.nn.Linear(2, 2)
    for n in range(last + 1):
        save_checkpoint(paths.checkpoint("actor", n), model)
    manifest = initial_manifest(cfg, paths, paths.checkpoint("actor", 0), None, kl_coef=None)
    publish(paths, manifest)
    for n in range(1, last + 1):
        manifest = next_manifest(
            manifest,
            cfg,
            paths,
            actor_checkpoint=paths.checkpoint("actor", n),
            critic_checkpoint=None,
            data_cursor={"epoch": 0, "offset": 4 * n},
            kl_coef=None,
            metrics={},
        )
        publish(paths, manifest)
    return paths


def optimizer_tensors(checkpoint_url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's optimizer state (``optim/``), by path, read with torch's
    own DCP -> torch.save converter (one process, no ranks)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out: dict[str, torch.Tensor] = {}

    def flat(value, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flat(v, f"{prefix}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                flat(v, f"{prefix}/{i}")
        elif isinstance(value, torch.Tensor):
            out[prefix] = value

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(storage.join(checkpoint_url, "optim"), os.path.join(tmp, "optim.pt"))
        flat(torch.load(os.path.join(tmp, "optim.pt"), weights_only=True), "")
    return out


def assert_same_state(url_a: str, url_b: str, exact: bool = True, atol: float = 0.0) -> None:
    """Two checkpoints hold the same state: weights, optimizer state and every rank's RNG (bit for
    bit with ``exact``, else within ``atol``)."""
    for read in (load_full_state_dict, optimizer_tensors):
        a, b = read(url_a), read(url_b)
        assert a.keys() == b.keys()
        if exact:
            diff = [k for k in a if not torch.equal(a[k], b[k])]
        else:
            diff = [k for k in a if not torch.allclose(a[k].double(), b[k].double(), rtol=0, atol=atol)]
        assert not diff, f"{url_a} and {url_b} differ in {diff[:5]}"
    if exact:
        assert rng_states(url_a) == rng_states(url_b)


def metric_history(n: int = 5) -> list[dict]:
    """``n`` iterations of metrics records as ``metrics.json`` holds them (a text value among them)."""
    return [
        {
            "iteration": i,
            "critic/score/mean": 0.1 * i,
            "critic/rewards/mean": 0.1 * i - 0.01,
            "actor/reward_kl_penalty": 0.01 * i,
            "response_length/mean": 2.0,
            "critic/vf_loss": 1.0 / i,
            "timestamp": 1.7e9 + 5 * i,
            "note": "text is skipped",
        }
        for i in range(1, n + 1)
    ]
