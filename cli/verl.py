"""``ppoflow run``'s config, with veRL's command line (``--verl KEY=VALUE ...``, docs/verl.md):

- :func:`add_run_arguments`: ``CONFIG`` (optional with ``--verl``), ``--iterations``, ``--set``,
  ``--verl``, ``--print-config``, ``--verbose``;
- :func:`run_config`: the config a ``run`` command line names (a file, its ``verl:`` section, the
  ``--verl`` overrides, the ``--set`` overrides, in that order of precedence from low to high);
- :func:`iterations`: how many iterations this run adds: ``--iterations``, else with veRL settings
  what ``trainer.total_training_steps`` (or ``total_epochs`` x the steps of an epoch, from the
  training files' parquet footers) leaves to do, else 1;
- :func:`print_config`, :func:`announce`: what ``--print-config`` prints, and the veRL line a run
  prints before it starts.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from ppoflow.cli.commands import CLIError

__all__ = ["add_run_arguments", "run_config", "iterations", "print_config", "announce", "verl_rerun"]


def add_run_arguments(p: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    p.add_argument(
        "config", nargs="?", default=None, help="YAML config: a path or fsspec URL (optional with --verl)"
    )
    p.add_argument(
        "--iterations",
        type=positive,
        default=None,
        help="iterations to add (default 1; with veRL settings: until trainer.total_training_steps "
        "or total_epochs is reached)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rollout.n=4 (YAML value; repeatable)",
    )
    p.add_argument(
        "--verl",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="a veRL command's Hydra overrides (main_ppo's KEY=VALUE, +KEY=VALUE, ~KEY), mapped onto "
        "ppoflow's config (docs/verl.md)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (with --verl: the mapped and ignored keys as comments) and exit",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show Prefect's and the ranks' logs, and tracebacks"
    )
    p.set_defaults(run_parser=p)


def _parse_sets(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rollout.n=4", code=2)
        out[key.strip()] = yaml.safe_load(value)
    return out


def run_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(config, veRL translation or None)`` of a ``run`` command line; CLIError (status 2) for a
    config that cannot run, a parser error for a command line with neither CONFIG nor --verl."""
    from ppoflow.infra.config import ConfigError, apply_overrides, parse_config
    from ppoflow.infra.config.loading import read_config_data, with_verl
    from ppoflow.infra.data import storage

    if args.config is None and not args.verl:
        args.run_parser.error("give a CONFIG, or a veRL command with --verl KEY=VALUE ...")
    sets = _parse_sets(args.overrides)
    try:
        data: dict[str, Any] = {}
        if args.config is not None:
            if not storage.exists(args.config):
                raise CLIError(f"config {args.config} does not exist", code=2)
            data = read_config_data(args.config)
        data, translation = with_verl(data, args.verl)
        source = args.config or "the --verl command"
        return parse_config(apply_overrides(data, sets), source=source), translation
    except ConfigError as err:
        raise CLIError(str(err), code=2) from None


def training_rows(cfg: Any) -> int:
    """The rows of ``data.train_files`` (their parquet footers only)."""
    import pyarrow.parquet as pq

    from ppoflow.infra.data import storage
    from ppoflow.infra.data.stream import expand_train_files

    options = cfg.storage.storage_options
    rows = 0
    for url in expand_train_files(cfg.data.train_files, options):
        fs, path = storage.url_to_fs(url, options)
        with fs.open(path, "rb") as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return rows


def _committed(cfg: Any) -> int:
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

    manifest = read_manifest(ExperimentPaths.of(cfg))
    return manifest.iteration if manifest is not None else 0


def target_steps(cfg: Any, translation: Any) -> tuple[int, str]:
    """veRL's length of the run in iterations, and how it was reached (for the messages)."""
    if translation.steps is not None:
        return translation.steps, f"trainer.total_training_steps={translation.steps}"
    epochs = translation.epochs if translation.epochs is not None else 30
    try:
        rows = training_rows(cfg)
    except (OSError, ValueError) as err:  # DataError is a ValueError
        raise CLIError(
            f"trainer.total_epochs needs the training rows, and they cannot be read: {err}", code=2
        ) from None
    per_epoch = rows // cfg.data.train_batch_size
    how = f"trainer.total_epochs={epochs} x {per_epoch} steps ({rows} rows // data.train_batch_size {cfg.data.train_batch_size})"
    return epochs * per_epoch, how


def iterations(
    args: argparse.Namespace, cfg: Any, translation: Any, out: Callable[[str], None] = print
) -> int:
    """The iterations this run adds (module docstring); with veRL's ``resume_mode=disable``, a
    CLIError when the experiment already has iterations."""
    if translation is not None and translation.resume_mode == "disable":
        done = _committed(cfg)
        if done:
            raise CLIError(
                f"trainer.resume_mode=disable, but {cfg.storage.experiment_url} has {done} committed "
                "iteration(s), which veRL would train over again from the start: name another "
                "trainer.experiment_name, remove the experiment, or drop resume_mode",
                code=2,
            )
    if args.iterations is not None:
        return int(args.iterations)
    if translation is None:
        return 1
    target, how = target_steps(cfg, translation)
    done = _committed(cfg)
    out(f"veRL: runs to iteration {target} ({how}); {done} committed, {max(0, target - done)} to run")
    return max(0, target - done)


def announce(translation: Any, out: Callable[[str], None] = print) -> None:
    """The veRL lines a run prints once: the ignored keys on one line, then any notes."""
    if translation is None:
        return
    if translation.ignored:
        out(
            f"veRL: {len(translation.ignored)} key(s) ignored (no meaning in ppoflow): "
            + ", ".join(translation.ignored)
        )
    for note in translation.notes:
        out(f"veRL: {note}")


def print_config(cfg: Any, translation: Any, out: Callable[[str], None] = print) -> None:
    """The resolved config as YAML; with veRL settings, preceded by the mapped and ignored keys
    as YAML comments (so that the whole output still reads as the config)."""
    from ppoflow.infra.config import dump_config

    if translation is not None:
        out(f"# veRL keys mapped ({len(translation.mapped)}):")
        for key, target in translation.mapped.items():
            out(f"#   {key} -> {target}")
        out(f"# veRL keys ignored ({len(translation.ignored)}):")
        for key, why in translation.ignored.items():
            out(f"#   {key}: {why}")
        for note in translation.notes:
            out(f"# note: {note}")
    out(dump_config(cfg).rstrip("\n"))


def verl_rerun(args: argparse.Namespace, options: str = "") -> str:
    """`` CONFIG OPTIONS --verl ...``: what follows ``ppoflow run`` to run this ``run`` again
    (the veRL overrides last: ``--verl`` takes every word after it)."""
    config = f" {shlex.quote(args.config)}" if args.config else ""
    verl = (" --verl " + " ".join(shlex.quote(item) for item in args.verl)) if args.verl else ""
    return config + options + verl
