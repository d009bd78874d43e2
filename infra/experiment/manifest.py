"""The experiment's state on storage: ``manifest.json`` at the experiment root, and its layout.

    <storage.root>/<storage.experiment>/
        manifest.json                    the last committed iteration (this module)
        lock.json                        held while a run is active (ppoflow.infra.experiment.lock)
        configs/<config_hash>.yaml       every config the experiment ran with
        iterations/000012/               rollout.arrow, ..., metrics.json, manifest.json (a copy)
        iterations/000012/tasks/*.json   one receipt per finished task
        checkpoints/actor/000012/        sharded (DCP) checkpoints
        checkpoints/critic/000012/
        data/after/000012.json           the training files the runs after iteration 12 read
                                         (ppoflow.infra.data.stream; and data/runs/<run>.json)
        promoted, promoted.json          the promoted policy (ppoflow.infra.experiment.promotion)
        queue/                           asynchronous training's rollouts and policy versions
                                         (ppoflow.infra.queue)

Manifests and receipts store paths relative to the experiment root (``ExperimentPaths.ref`` /
``url``), so an experiment directory can be copied or moved as a whole.

The manifest of iteration n says where iteration n+1 starts from: the actor and critic
checkpoints, the data cursor, the KL controller's coefficient. Iteration 0 is the initial state
(checkpoints of the base weights). ``commit`` publishes manifest n in two writes: first the copy in
``iterations/n/manifest.json``, then the root ``manifest.json`` (each write atomic). Until the
second write lands, iteration n did not happen. To roll an experiment back to iteration k, copy
``iterations/k/manifest.json`` over the root manifest.

An experiment's identity (base model, tokenizer, critic model) is fixed at iteration 0; a config
that changes it is refused (:class:`IdentityMismatch`). Everything else may change between runs;
each new config is stored under ``configs/`` and listed in ``config_history``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ppoflow.infra.config import ConfigError, ExperimentConfig, dump_config
from ppoflow.infra.data import storage
from ppoflow.infra.data.prompts import DataCursor
from ppoflow.infra.experiment.metrics import TREND_KEYS
from ppoflow.infra.experiment.paths import LAYOUT, ExperimentPaths, OutsideExperiment

__all__ = [
    "FORMAT",
    "ExperimentPaths",
    "Manifest",
    "IdentityMismatch",
    "ManifestConflict",
    "OutsideExperiment",
    "LAYOUT",
    "read_manifest",
    "check_identity",
    "record_config",
    "initial_manifest",
    "next_manifest",
    "publish",
    "now_iso",
]

FORMAT = 1


def now_iso() -> str:
    """The current UTC time, ISO 8601 with seconds."""
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


class IdentityMismatch(ConfigError):
    """The config names other weights or another tokenizer than the experiment was built with."""


class ManifestConflict(RuntimeError):
    """The manifest on storage is not the one this commit builds on (another writer, or a
    manifest from a newer ppoflow)."""


@dataclass
class Manifest:
    """One committed iteration of an experiment (see the module docstring)."""

    experiment: str
    iteration: int
    actor_checkpoint: str  # relative to the experiment root (ExperimentPaths.url)
    critic_checkpoint: str | None
    config_hash: str
    identity: dict[str, Any]
    data_cursor: DataCursor
    kl_coef: float | None
    created_at: str
    committed_at: str
    config_history: list[dict[str, Any]] = field(default_factory=list)
    trend: list[dict[str, Any]] = field(default_factory=list)
    format: int = FORMAT
    # what iteration n+1's rollout and values use when not actor/critic_checkpoint (one-step
    # off-policy: the checkpoints of iteration n-1); {"actor": ref, "critic": ref}; None = those
    rollout_checkpoints: dict[str, str | None] | None = None
    # per role, the updates since its last written state (snapshot), oldest first: {iteration,
    # state, previous, batch, bytes, xxh3} (ppoflow.tasks.replay); empty: its state is written.
    # An entry with "snapshot": true is a deferred snapshot: its state was being written when the
    # iteration committed (a later commit starts the chain after it once it is complete)
    replay: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # the training files read so far, in stream order: {url, rows, bytes, xxh3, joined}
    # (ppoflow.infra.data.stream)
    data_files: list[dict[str, Any]] = field(default_factory=list)
    # asynchronous training: the queue's batch this iteration consumed ({file, xxh3, bytes, rows,
    # versions, ...}: ppoflow.infra.queue.batches; the same bytes as iterations/n/rollout.arrow)
    consumed: dict[str, Any] | None = None

    def state(self, role: str) -> str | None:
        """The reference of ``role``'s state after this iteration (written or to be replayed)."""
        return self.actor_checkpoint if role == "actor" else self.critic_checkpoint

    def snapshot(self, role: str) -> str | None:
        """The written state ``role``'s state is rebuilt from (the state itself when written)."""
        chain = self.replay.get(role)
        return chain[0]["previous"] if chain else self.state(role)

    def checkpoints(self) -> list[str]:
        """Every checkpoint this manifest needs on storage (relative references): each role's
        snapshot, and the rollout's when it is not a replayed state of the chains."""
        replayed = {entry["state"] for chain in self.replay.values() for entry in chain}
        refs = [self.snapshot("actor"), self.snapshot("critic")]
        refs += [r for r in (self.rollout_checkpoints or {}).values() if r not in replayed]
        # a deferred snapshot is kept while it may be written (retention must not take it away)
        refs += [e["state"] for chain in self.replay.values() for e in chain if e.get("snapshot")]
        return sorted({r for r in refs if r})

    def settled(self, complete: Callable[[str], bool]) -> Manifest:
        """This manifest with each role's chain started after its last deferred snapshot that
        ``complete`` (a relative reference -> bool) says is written by now."""
        chains = {}
        for role, chain in self.replay.items():
            done = [i for i, e in enumerate(chain) if e.get("snapshot") and complete(e["state"])]
            rest = chain[done[-1] + 1 :] if done else chain
            if rest:
                chains[role] = rest
        return replace(self, replay=chains)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any], url: str = "manifest.json") -> Manifest:
        fmt = data.get("format", 0)
        if fmt != FORMAT:
            raise ManifestConflict(
                f"{url}: manifest format {fmt}, this ppoflow reads format "
                f"{FORMAT}; use the ppoflow version that wrote it"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise ManifestConflict(f"{url}: not a ppoflow manifest ({exc})") from None


def read_manifest(paths: ExperimentPaths) -> Manifest | None:
    """The committed manifest, or None if the experiment was never initialised."""
    if not storage.exists(paths.manifest):
        return None
    return Manifest.from_json(storage.read_json(paths.manifest), paths.manifest)


def check_identity(manifest: Manifest, cfg: ExperimentConfig) -> None:
    """Refuse a config whose base model, tokenizer or critic model differ from the experiment's."""
    new = cfg.identity()
    for key in [*new, *(k for k in manifest.identity if k not in new)]:  # model.path first
        old_v, new_v = manifest.identity.get(key), new.get(key)
        if old_v != new_v:
            raise IdentityMismatch(
                f"experiment {cfg.storage.experiment!r} at {cfg.storage.experiment_url} was built "
                f"with {key}={old_v!r}, but this config has {key}={new_v!r}. Its checkpoints belong "
                f"to the old setting, so continuing would corrupt it. To train with the new "
                f"setting start a new experiment (set storage.experiment to a new name); to continue "
                f"this one set {key} back to {old_v!r}."
            )


def record_config(paths: ExperimentPaths, cfg: ExperimentConfig) -> str:
    """Store the config as ``configs/<hash>.yaml`` (once per hash); return its URL."""
    url = paths.config(cfg.config_hash())
    if not storage.exists(url):
        storage.write_bytes_atomic(url, dump_config(cfg).encode())
    return url


def _history(
    previous: list[dict[str, Any]], n: int, cfg: ExperimentConfig, config_url: str
) -> list[dict[str, Any]]:
    h = cfg.config_hash()
    if previous and previous[-1]["config_hash"] == h:
        return list(previous)
    return [*previous, {"iteration": n, "config_hash": h, "config": config_url}]


def initial_manifest(
    cfg: ExperimentConfig,
    paths: ExperimentPaths,
    actor_checkpoint: str,
    critic_checkpoint: str | None,
    kl_coef: float | None,
) -> Manifest:
    """Manifest 0: the base weights' checkpoints, the data cursor at its start."""
    now = now_iso()
    return Manifest(
        experiment=cfg.storage.experiment,
        iteration=0,
        actor_checkpoint=paths.ref(actor_checkpoint),
        critic_checkpoint=paths.ref(critic_checkpoint),
        config_hash=cfg.config_hash(),
        identity=cfg.identity(),
        data_cursor=DataCursor(epoch=0, offset=0),
        kl_coef=kl_coef,
        created_at=now,
        committed_at=now,
        config_history=_history([], 0, cfg, paths.ref(record_config(paths, cfg))),
    )


def next_manifest(
    prev: Manifest,
    cfg: ExperimentConfig,
    paths: ExperimentPaths,
    *,
    actor_checkpoint: str,
    critic_checkpoint: str | None,
    data_cursor: DataCursor,
    kl_coef: float | None,
    metrics: dict[str, Any],
    rollout_checkpoints: dict[str, str | None] | None = None,
    before: dict[str, Any] | None = None,
    updated: dict[str, dict[str, Any] | None] | None = None,
    data_files: list[dict[str, Any]] | None = None,
    consumed: dict[str, Any] | None = None,
) -> Manifest:
    """Manifest ``prev.iteration + 1`` after an iteration ran with ``cfg``. ``before``: metrics of
    iteration ``prev.iteration`` measured after it was committed (the evaluation of iteration 0,
    which runs once manifest 0 exists), added to the trend ahead of the new iteration's row.
    ``updated``: the roles this iteration updated, each with None (its state was written) or the
    record of the update to replay (``ppoflow.tasks.replay.replay_entry``). ``data_files``: the
    records of the files the run trains on (default: ``prev``'s). ``consumed``: the record of the
    queue's batch the iteration trained on (asynchronous training)."""
    n = prev.iteration + 1
    row = {"iteration": n, **{k: metrics[k] for k in TREND_KEYS if k in metrics}}
    rows = (
        [{"iteration": prev.iteration, **{k: before[k] for k in TREND_KEYS if k in before}}] if before else []
    )
    return Manifest(
        experiment=prev.experiment,
        iteration=n,
        actor_checkpoint=paths.ref(actor_checkpoint),
        critic_checkpoint=paths.ref(critic_checkpoint),
        config_hash=cfg.config_hash(),
        identity=prev.identity,
        data_cursor=_cursor(data_cursor),
        kl_coef=kl_coef,
        created_at=prev.created_at,
        committed_at=now_iso(),
        config_history=_history(prev.config_history, n, cfg, paths.ref(record_config(paths, cfg))),
        trend=[*prev.trend, *rows, row],
        rollout_checkpoints=(
            {role: paths.ref(url) for role, url in rollout_checkpoints.items()}
            if rollout_checkpoints
            else None
        ),
        replay=_chains(prev.replay, updated or {}),
        data_files=[dict(r) for r in (prev.data_files if data_files is None else data_files)],
        consumed=consumed,
    )


def _cursor(cursor: DataCursor) -> DataCursor:
    out = DataCursor(epoch=int(cursor["epoch"]), offset=int(cursor["offset"]))
    if cursor.get("fresh") is not None:
        out["fresh"] = int(cursor["fresh"])
    return out


def _chains(
    previous: dict[str, list[dict[str, Any]]], updated: dict[str, dict[str, Any] | None]
) -> dict[str, list[dict[str, Any]]]:
    """Each role's updates since its last written state: a written state ends the chain, a
    replayed one extends it, a role not updated keeps its chain."""
    chains = {role: list(chain) for role, chain in previous.items()}
    for role, entry in updated.items():
        chains[role] = [] if entry is None else [*chains.get(role, []), entry]
    return {role: chain for role, chain in chains.items() if chain}


def publish(paths: ExperimentPaths, manifest: Manifest) -> None:
    """Publish ``manifest``: the per-iteration copy, then the root manifest (the commit point).

    The root must hold iteration ``manifest.iteration - 1`` (or nothing, for iteration 0); a
    root already at ``manifest.iteration`` is accepted when it is this same commit (a retried
    commit). Anything else raises :class:`ManifestConflict`.
    """
    n = manifest.iteration
    current = read_manifest(paths)
    if current is not None and current.iteration == n:
        same = (
            current.actor_checkpoint == manifest.actor_checkpoint
            and current.critic_checkpoint == manifest.critic_checkpoint
        )
        if same:
            return
    expected = None if n == 0 else n - 1
    found = None if current is None else current.iteration
    if found != expected:
        raise ManifestConflict(
            f"{paths.manifest}: commit of iteration {n} expected the manifest at "
            f"{'no manifest' if expected is None else f'iteration {expected}'}, found "
            f"{'none' if found is None else f'iteration {found}'}. Another run may have advanced "
            f"this experiment; rerun the flow to continue from the manifest on storage."
        )
    data = manifest.to_json()
    storage.write_json_atomic(paths.file(n, "manifest.json"), data)
    storage.write_json_atomic(paths.manifest, data)
