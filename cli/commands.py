"""The commands that read or change an experiment on storage without running a flow:
``status``, ``export-hf``, ``rollback``, ``tensorboard`` (the parser is in :mod:`ppoflow.cli.main`)."""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any

__all__ = [
    "CLIError",
    "cmd_status",
    "cmd_export_hf",
    "cmd_rollback",
    "cmd_tensorboard",
    "cmd_import_gguf",
    "read_state",
    "experiment_config",
]


class CLIError(Exception):
    """A user-facing error: printed as ``ppoflow: error: <message>``; exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _experiment_url(text: str) -> str:
    """An experiment URL from a URL/path or a YAML config naming one."""
    from ppoflow.infra.config import ConfigError, load_config
    from ppoflow.infra.data import storage

    if text.endswith((".yaml", ".yml")):
        if not storage.exists(text):
            raise CLIError(f"config {text} does not exist")
        try:
            return load_config(text).storage.experiment_url
        except ConfigError as err:
            raise CLIError(str(err), code=2) from None
    return text.rstrip("/")


def read_state(text: str):
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.manifest import ExperimentPaths, ManifestConflict, read_manifest

    url = _experiment_url(text)
    if not storage.exists(storage.join(url, "manifest.json")) and storage.exists(
        storage.join(url, "config.yaml")
    ):
        url = _experiment_url(storage.join(url, "config.yaml"))  # a demo directory: its experiment
    paths = ExperimentPaths(url)
    try:
        manifest = read_manifest(paths)
    except ManifestConflict as err:
        raise CLIError(str(err)) from None
    if manifest is None:
        hint = " (it exists but holds no manifest.json)" if storage.exists(url) else " (no such directory)"
        raise CLIError(
            f"no experiment at {url}{hint}; give the experiment's directory "
            "(<storage.root>/<storage.experiment>) or its config YAML"
        )
    return paths, manifest


def experiment_config(text: str) -> Any:
    """The config of an experiment: the YAML config given, or the last config the experiment at
    the URL/path ``text`` committed with."""
    from ppoflow.infra.config import ConfigError, load_config

    if text.endswith((".yaml", ".yml")):
        try:
            return load_config(text)
        except FileNotFoundError:
            raise CLIError(f"config {text} does not exist", code=2) from None
        except ConfigError as err:
            raise CLIError(str(err), code=2) from None
    paths, manifest = read_state(text)
    if not manifest.config_history:
        raise CLIError(f"{paths.root} records no config; give the experiment's YAML config instead")
    cfg = load_config(paths.url(manifest.config_history[-1]["config"]))
    # the experiment where it is now (it may have been copied or moved since the config was written)
    parent, _, name = paths.root.rpartition("/")
    return cfg.model_copy(
        update={"storage": cfg.storage.model_copy(update={"root": parent, "experiment": name})}
    )


def cmd_status(args: argparse.Namespace) -> int:
    from ppoflow.cli.queue_status import print_queue, queue_status_of
    from ppoflow.infra.data import storage

    paths, manifest = read_state(args.experiment)
    n = manifest.iteration
    metrics = (
        storage.read_json(paths.file(n, "metrics.json"))
        if n and storage.exists(paths.file(n, "metrics.json"))
        else {}
    )
    new = _new_data(args.experiment, manifest)
    if args.json:
        from ppoflow.infra.experiment.retention import checkpoint_sizes

        data = {"read": manifest.data_files, "new": new}
        state = {
            "manifest": manifest.to_json(),
            "metrics": metrics,
            "checkpoints": checkpoint_sizes(paths, n),
            "queue": queue_status_of(paths, n),
        }
        print(json.dumps({**state, "data": data}, indent=1, sort_keys=True))
        return 0
    width = _print_state(paths, manifest, new)
    _print_trend(manifest, width)
    _print_evaluations(paths, n)
    _print_checkpoints(paths, n)
    print_queue(paths, n)  # asynchronous training's rollout queue
    _print_metrics(paths, n, metrics)
    return 0


def _print_state(paths: Any, manifest: Any, new: list[str] | str) -> int:
    """The manifest's lines (experiment, iteration, states, data, promotion, config, identity);
    returns the width of their labels."""
    n = manifest.iteration
    config = manifest.config_history[-1]["config"] if manifest.config_history else None
    cursor = manifest.data_cursor
    rows = [
        ("experiment", f"{manifest.experiment}  ({paths.root})"),
        ("iteration", f"{n} (committed {manifest.committed_at}; created {manifest.created_at})"),
        ("actor state", _state_line(paths, manifest, "actor")),
        ("critic state", _state_line(paths, manifest, "critic")),
        ("data cursor", f"epoch {cursor.get('epoch')}, offset {cursor.get('offset')}"),
        ("data read", _read_line(manifest.data_files)),
        (
            "data new",
            new if isinstance(new, str) else (", ".join(new) or "none") + " (joins at the next run)",
        ),
        ("promoted", _promoted_line(paths)),
        ("kl coef", manifest.kl_coef if manifest.kl_coef is not None else "-"),
        ("config", f"{paths.url(config) if config else '-'} (hash {manifest.config_hash})"),
    ]
    rows += [(k, v) for k, v in sorted(manifest.identity.items())]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return width


def _print_trend(manifest: Any, width: int) -> None:
    """The training and held-out scores, first and last."""
    from ppoflow.infra.experiment.metrics import headline

    for name, label in (("score", "score"), ("val", "held-out score")):
        h = headline(name)
        having = [r for r in manifest.trend if h.key_in(r)]
        if having:
            first, last = having[0], having[-1]
            print(
                f"{label:<{width}}  {h.value(first):.3f} (iteration {first['iteration']}) -> "
                f"{h.value(last):.3f} (iteration {last['iteration']})"
            )


def _print_metrics(paths: Any, n: int, metrics: dict[str, Any]) -> None:
    """The last iteration's metrics, one per line."""
    if metrics:
        print(f"\nmetrics of iteration {n} ({paths.file(n, 'metrics.json')}):")
        mw = max(len(k) for k in metrics)
        for key, value in sorted(metrics.items()):
            shown = f"{value:.6g}" if isinstance(value, float) else value
            print(f"  {key:<{mw}}  {shown}")
    elif n == 0:
        print("\nno iteration has run yet (iteration 0 is the initial state)")


def _promoted_line(paths: Any) -> str:
    from ppoflow.infra.experiment.promotion import current_promotion, promoted_url, promotion_line

    record = current_promotion(paths)
    return "-" if record is None else f"{promotion_line(record)} at {promoted_url(paths)}"


def _read_line(records: list[dict[str, Any]]) -> str:
    if not records:
        return "-"
    rows = sum(int(r["rows"]) for r in records)
    last = records[-1]["joined"]
    return f"{len(records)} file(s), {rows} rows (the last joined at iteration {last})"


def _new_data(text: str, manifest: Any) -> list[str] | str:
    """The training files the experiment's config names that it has not read yet, or why that
    is not known."""
    from ppoflow.infra.config import ConfigError
    from ppoflow.infra.data.prompts import DataError
    from ppoflow.infra.data.stream import new_files

    try:
        cfg = experiment_config(text)
        return new_files(cfg.data.train_files, manifest.data_files, cfg.storage.storage_options or None)
    except (CLIError, ConfigError, DataError, OSError) as err:
        return f"unknown ({err})"


def _state_line(paths: Any, manifest: Any, role: str) -> str:
    """Where ``role``'s state is: its checkpoint, or the snapshot a resume replays it from."""
    from ppoflow.infra.checkpoint.marker import is_complete

    state = manifest.state(role)
    if state is None:
        return "-"
    manifest = manifest.settled(lambda ref: is_complete(paths.url(ref)))  # deferred snapshots written since
    chain = manifest.replay.get(role, [])
    if not chain:
        return f"{paths.url(state)} (a snapshot)"
    return (
        f"iteration {manifest.iteration}, rebuilt on resume from the snapshot {paths.url(manifest.snapshot(role))} "
        f"by replaying {len(chain)} update(s) (iterations {chain[0]['iteration']}-{chain[-1]['iteration']})"
    )


def _print_evaluations(paths: Any, n: int) -> None:
    """The evaluations kept on storage (iterations with an ``eval/`` directory), one line each."""
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.evaluation import EVAL_DIR

    rows = []
    iterations = storage.join(paths.root, "iterations")
    listed = storage.listdir(iterations) if storage.exists(iterations) else []
    for k in sorted(int(name) for name in listed if name.isdigit() and int(name) <= n):
        root = paths.file(k, EVAL_DIR)
        for tag in storage.listdir(root) if storage.exists(root) else []:
            url = storage.join(root, tag, "metrics.json")
            if storage.exists(url):
                m = storage.read_json(url)
                score, prompts = m.get("val/score", float("nan")), int(m.get("val/prompts", 0))
                rows.append(f"  {k:>9}  {tag:<18} {score:.4f}  ({prompts} prompts)")
    if rows:
        print(f"\nevaluations ({paths.root}/iterations/<n>/{EVAL_DIR}/<files>/):")
        print(f"  {'iteration':>9}  {'files':<18} val/score")
        print("\n".join(rows))


def _gb(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e9:.3f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def _print_checkpoints(paths, n: int) -> None:
    """The checkpoints on storage per iteration: size per role, and which can be resumed from."""
    from ppoflow.infra.experiment.retention import checkpoint_sizes

    rows = checkpoint_sizes(paths, n)
    if not rows:
        return
    by_iteration: dict[int, dict[str, dict]] = {}
    for entry in rows:
        by_iteration.setdefault(entry["iteration"], {})[entry["role"]] = entry
    print(f"\ncheckpoints kept ({paths.root}/checkpoints):")
    print(f"  {'iteration':>9}  {'actor':>10}  {'critic':>10}  note")
    total = 0
    for k, roles in sorted(by_iteration.items()):
        cells, notes = [], []
        for role in ("actor", "critic"):
            row = roles.get(role)
            cells.append(_gb(row["bytes"]) if row else "-")
            total += (row or {}).get("bytes") or 0
            if row and not row["complete"]:
                notes.append(f"{role} incomplete")
            elif row and row["resumable"] is False:
                notes.append(f"{role} weights only")
        print(f"  {k:>9}  {cells[0]:>10}  {cells[1]:>10}  {', '.join(notes)}")
    print(f"  {'total':>9}  {_gb(total):>22}")


def cmd_rollback(args: argparse.Namespace) -> int:
    from ppoflow.infra.experiment.lock import ExperimentLocked
    from ppoflow.infra.experiment.rollback import RollbackRefused, rollback

    paths, manifest = read_state(args.experiment)
    before = manifest.iteration
    try:
        target = rollback(paths, args.to)
    except (RollbackRefused, ExperimentLocked) as err:
        raise CLIError(str(err)) from None
    later = (
        f"; iterations {args.to + 1}-{before} stay on storage until rerun iterations replace them"
        if before > args.to
        else ""
    )
    print(
        f"{paths.root}: now at iteration {target.iteration} (was {before}); its checkpoints verified{later}.\n"
        f"continue training from it: ppoflow run <config.yaml> --iterations N"
    )
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from ppoflow.infra.checkpoint.hf_export import export_hf
    from ppoflow.infra.checkpoint.sharded import CheckpointError, is_complete
    from ppoflow.infra.data import storage

    paths, manifest = read_state(args.experiment)
    n = manifest.iteration if args.iteration is None else args.iteration
    if n > manifest.iteration:
        raise CLIError(f"--iteration {n}: the experiment's last committed iteration is {manifest.iteration}")
    source = manifest.to_json() if n == manifest.iteration else None
    if source is None:
        url = paths.file(n, "manifest.json")
        if not storage.exists(url):
            raise CLIError(f"--iteration {n}: no committed manifest at {url}")
        source = storage.read_json(url)
    checkpoint = paths.url(source.get(f"{args.role}_checkpoint"))
    if checkpoint is None:
        raise CLIError(f"the experiment has no {args.role} checkpoint (is the critic disabled?)")
    key = "model.path" if args.role == "actor" else "critic.model"
    base = manifest.identity.get(key) or manifest.identity.get("model.path")
    if not base or not os.path.isdir(base):
        raise CLIError(
            f"the experiment's base model {base!r} ({key}) is not a local directory; export_hf "
            "copies config and tokenizer from it"
        )
    scratch, lora = None, _lora_of(args.experiment, args.role)
    try:
        if not is_complete(checkpoint):  # not a snapshot iteration: rebuilt from the latest one
            scratch = storage.join(paths.root, "scratch", f"export-{uuid.uuid4().hex[:12]}")
            checkpoint = _rebuilt(args.experiment, args.role, checkpoint, scratch)
        if lora is not None:
            from ppoflow.infra.checkpoint.lora_export import export_lora

            out = export_lora(checkpoint, args.out, base, lora, merge=args.merge, dtype=args.dtype)
        else:
            tokenizer = manifest.identity.get("model.tokenizer") if args.role == "actor" else None
            out = export_hf(checkpoint, args.out, base, dtype=args.dtype, tokenizer_path=tokenizer)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        raise CLIError(str(err)) from None
    finally:
        if scratch is not None and storage.exists(scratch):
            storage.rm(scratch, recursive=True)
    what = "a Hugging Face directory" if lora is None or args.merge else "a PEFT adapter directory"
    print(f"wrote {what} of the {args.role} at iteration {n} to {out}")
    return 0


def _lora_of(experiment: str, role: str) -> Any:
    """The run's ``actor.lora`` when it trained the policy's adapters (None: full weights, or an
    experiment that records no config: ``export_hf`` then refuses an adapters-only checkpoint)."""
    try:
        cfg = experiment_config(experiment)
    except CLIError:
        return None
    lora = getattr(cfg, role).lora
    if not lora.enabled:
        return None
    if role != "actor":
        raise CLIError("the critic of a LoRA run exports only through its checkpoint; export the actor")
    return lora


def _rebuilt(experiment: str, role: str, state: str, scratch: str) -> str:
    """``state`` (not written) rebuilt by replay into a checkpoint under ``scratch``."""
    from ppoflow.infra.data import storage
    from ppoflow.tasks.run.materialize import materialize_state

    cfg = experiment_config(experiment)
    return materialize_state(cfg, role, state, storage.join(scratch, role), say=print)


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.tensorboard import write_events

    paths, manifest = read_state(args.experiment)
    history = []
    for n in range(1, manifest.iteration + 1):
        url = paths.file(n, "metrics.json")
        if storage.exists(url):  # an experiment rolled back or copied in part may lack some
            history.append(storage.read_json(url))
    logdir = args.logdir or storage.join(paths.root, "tensorboard")
    try:
        url = write_events(history, logdir)
    except ImportError as err:
        raise CLIError(str(err)) from None
    print(f"wrote {len(history)} iteration(s) of metrics to {url}\nview them: tensorboard --logdir {logdir}")
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from ppoflow.infra.checkpoint.gguf_import import import_gguf

    try:
        out = import_gguf(args.source, args.out, dtype=args.dtype)
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as err:
        raise CLIError(str(err)) from None
    print(f"a Hugging Face model directory from {args.source}: {out}")
    return 0
