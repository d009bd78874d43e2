"""The ``ppoflow`` command line.

    ppoflow demo [--storage DIR] [--iterations N] [--verbose]   build + train the tiny CPU demo
    ppoflow run CONFIG [--iterations N] [--set KEY=VALUE ...]    run the ``ppo`` flow on a config
    ppoflow status EXPERIMENT [--json]                           manifest + last metrics
    ppoflow export-hf EXPERIMENT [--iteration N] OUT             a Hugging Face directory
    ppoflow rollback EXPERIMENT --to N                           make committed iteration N the latest
    ppoflow tensorboard EXPERIMENT [--logdir DIR]                TensorBoard event files of the metrics
    ppoflow agent --driver HOST:PORT [--node-rank K]             one node of multi-node worker groups

``EXPERIMENT`` is an experiment's URL (``<storage.root>/<storage.experiment>``, any fsspec URL or
path) or the YAML config of one. ``run`` and ``demo`` run the flow in this process: against the
Prefect server in ``PREFECT_API_URL`` if set, else a temporary local one that ends with this
process however it ends (``ppoflow.flows.local_api``; runs then show in the UI of ``prefect server
start`` on this machine). Both print one line per committed iteration, Prefect's warnings, and at
the end a summary, or on failure one error block (``ppoflow.flows.failure``); ``--verbose`` adds
Prefect's and the ranks' logs and the traceback.

Exit status: 0 success, 1 a failed run or operation, 2 a bad command line or config, 130/143 on
Ctrl-C / SIGTERM (after the flow's cleanup ran: worker groups killed, experiment lock and device
slots released, the temporary Prefect server stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main", "build_parser", "CLIError"]


class CLIError(Exception):
    """A user-facing error: printed as ``ppoflow: error: <message>``; exit status ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppoflow", description="PPO for language models on FSDP2 + vLLM, every iteration a Prefect flow."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "demo", help="build and train the tiny CPU demo (idempotent: a second call continues it)"
    )
    p.add_argument("--storage", default="runs/demo", help="the demo's directory (default: ./runs/demo)")
    p.add_argument(
        "--iterations",
        type=_positive,
        default=None,
        help="PPO iterations to run now (default: the demo's own length on a new "
        "experiment, 10 more when continuing one)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show Prefect's and the ranks' logs in the terminal"
    )

    p = sub.add_parser("run", help="run the ppo flow on an experiment config")
    p.add_argument("config", help="YAML config: a path or fsspec URL")
    p.add_argument("--iterations", type=_positive, default=1, help="iterations to add (default 1)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set rollout.n=4 (YAML value; repeatable)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show Prefect's and the ranks' logs, and tracebacks"
    )
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # the default since 0.3

    p = sub.add_parser("status", help="print an experiment's manifest and its last metrics")
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument("--json", action="store_true", help="print {manifest, metrics} as JSON")

    p = sub.add_parser("export-hf", help="write a Hugging Face model directory from a checkpoint")
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument("out", help="output directory (local)")
    p.add_argument(
        "--iteration", type=_positive, default=None, help="committed iteration (default: the latest)"
    )
    p.add_argument(
        "--role", choices=("actor", "critic"), default="actor", help="which model (default: actor)"
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="cast the weights (default: keep the checkpoint's dtype)",
    )

    p = sub.add_parser(
        "rollback", help="move an experiment back to an earlier committed iteration (verified first)"
    )
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument(
        "--to", dest="to", type=_positive, required=True, help="the committed iteration to go back to"
    )

    p = sub.add_parser(
        "tensorboard", help="write TensorBoard event files of an experiment's per-iteration metrics"
    )
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument(
        "--logdir", default=None, help="where the event file goes (default: <experiment>/tensorboard)"
    )

    from ppoflow.infra.remote.agent.node_agent import add_arguments as add_agent_arguments

    p = sub.add_parser(
        "agent",
        help="serve as one node of the worker groups of runs with resources.launch: rendezvous",
        description="Dial the driver's control endpoint and run its worker groups' ranks on this node "
        "(torchrun with a c10d rendezvous). The cluster key comes from PPOFLOW_CLUSTER_KEY_FILE or "
        "PPOFLOW_CLUSTER_KEY.",
    )
    add_agent_arguments(p)
    return parser


def _parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CLIError(f"--set {item!r}: expected KEY=VALUE, e.g. --set rollout.n=4", code=2)
        out[key.strip()] = yaml.safe_load(value)
    return out


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


def _read_state(text: str):
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


def cmd_status(args: argparse.Namespace) -> int:
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.metrics import headline

    paths, manifest = _read_state(args.experiment)
    n = manifest.iteration
    metrics = (
        storage.read_json(paths.file(n, "metrics.json"))
        if n and storage.exists(paths.file(n, "metrics.json"))
        else {}
    )
    if args.json:
        from ppoflow.infra.experiment.retention import checkpoint_sizes

        sizes = checkpoint_sizes(paths, n)
        print(
            json.dumps(
                {"manifest": manifest.to_json(), "metrics": metrics, "checkpoints": sizes},
                indent=1,
                sort_keys=True,
            )
        )
        return 0
    config = manifest.config_history[-1]["config"] if manifest.config_history else None
    rows = [
        ("experiment", f"{manifest.experiment}  ({paths.root})"),
        ("iteration", f"{n} (committed {manifest.committed_at}; created {manifest.created_at})"),
        ("actor checkpoint", paths.url(manifest.actor_checkpoint)),
        ("critic checkpoint", paths.url(manifest.critic_checkpoint) or "-"),
        (
            "data cursor",
            f"epoch {manifest.data_cursor.get('epoch')}, offset {manifest.data_cursor.get('offset')}",
        ),
        ("kl coef", manifest.kl_coef if manifest.kl_coef is not None else "-"),
        ("config", f"{paths.url(config) if config else '-'} (hash {manifest.config_hash})"),
    ]
    rows += [(k, v) for k, v in sorted(manifest.identity.items())]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    if manifest.trend and len(manifest.trend) > 1:
        first, last = manifest.trend[0], manifest.trend[-1]
        score = headline("score")
        if score.key_in(first) and score.key_in(last):
            print(
                f"{'score':<{width}}  {score.value(first):.3f} (iteration {first['iteration']}) -> "
                f"{score.value(last):.3f} (iteration {last['iteration']})"
            )
    _print_checkpoints(paths, n)
    if metrics:
        print(f"\nmetrics of iteration {n} ({paths.file(n, 'metrics.json')}):")
        mw = max(len(k) for k in metrics)
        for key, value in sorted(metrics.items()):
            shown = f"{value:.6g}" if isinstance(value, float) else value
            print(f"  {key:<{mw}}  {shown}")
    elif n == 0:
        print("\nno iteration has run yet (iteration 0 is the initial state)")
    return 0


def _gb(size: int | None) -> str:
    return "-" if size is None else f"{size / 1e9:.3f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def _print_checkpoints(paths, n: int) -> None:
    """The checkpoints on storage per iteration: size per role, and which can be resumed from."""
    from ppoflow.infra.experiment.retention import checkpoint_sizes

    rows = checkpoint_sizes(paths, n)
    if not rows:
        return
    by_iteration: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_iteration.setdefault(row["iteration"], {})[row["role"]] = row
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

    paths, manifest = _read_state(args.experiment)
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

    paths, manifest = _read_state(args.experiment)
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
    if not is_complete(checkpoint):
        raise CLIError(f"checkpoint {checkpoint} is missing or incomplete")
    key = "model.path" if args.role == "actor" else "critic.model"
    base = manifest.identity.get(key) or manifest.identity.get("model.path")
    if not base or not os.path.isdir(base):
        raise CLIError(
            f"the experiment's base model {base!r} ({key}) is not a local directory; export_hf "
            "copies config and tokenizer from it"
        )
    try:
        out = export_hf(checkpoint, args.out, base, dtype=args.dtype)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        raise CLIError(str(err)) from None
    print(f"wrote a Hugging Face directory of the {args.role} at iteration {n} to {out}")
    return 0


def cmd_tensorboard(args: argparse.Namespace) -> int:
    from ppoflow.infra.data import storage
    from ppoflow.infra.experiment.tensorboard import write_events

    paths, manifest = _read_state(args.experiment)
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


def _rerun(args: argparse.Namespace) -> str:
    """The command line that runs this command again (what the failure screen suggests)."""
    import shlex

    from ppoflow.flows.console import command

    if args.command == "demo":
        return f"{command('ppoflow')} demo --storage {shlex.quote(args.storage)}"
    sets = "".join(f" --set {shlex.quote(item)}" for item in args.overrides)
    return f"{command('ppoflow')} run {shlex.quote(args.config)} --iterations {args.iterations}{sets}"


@contextlib.contextmanager
def _interrupts(args: argparse.Namespace, cfg: Any) -> Iterator[None]:
    """From here on SIGTERM and Ctrl-C raise, so that the run's cleanup runs; on either, say what
    was left behind (the flow's cleanup already ran), then go on exiting. The run's heavy imports
    happen first, while either still ends the process at once (``flows.signals``)."""
    import ppoflow.flows.ppo  # noqa: F401 - torch, Prefect, the tasks: imported before signals raise
    from ppoflow.flows.failure import committed, print_interrupted
    from ppoflow.flows.signals import Terminated, install_stop_handlers

    started, before = time.time(), committed(cfg)
    install_stop_handlers()
    try:
        yield
    except (KeyboardInterrupt, Terminated) as exc:
        how = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
        print_interrupted(cfg, how, time.time() - started, _rerun(args), before=before, out=_err)
        raise


def _err(line: str) -> None:
    print(line, file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from ppoflow.infra.config import ConfigError, load_config
    from ppoflow.infra.data import storage

    # the config's own checks come first: a bad config is told at once, before the run's heavy
    # imports and without starting a Prefect server
    if not storage.exists(args.config):
        raise CLIError(f"config {args.config} does not exist", code=2)
    try:
        cfg = load_config(args.config, _parse_overrides(args.overrides))
    except ConfigError as err:
        raise CLIError(str(err), code=2) from None
    _prepare_run()
    from ppoflow.flows.console import print_summary, run_with_progress
    from ppoflow.flows.failure import print_failure, terminal

    with terminal(args.verbose), _interrupts(args, cfg):
        result = run_with_progress(cfg, args.iterations)
    if not result["ok"]:
        print_failure(cfg, result, rerun=_rerun(args), verbose=args.verbose, out=_err)
        return 1
    print_summary(cfg, result, config_path=args.config)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ppoflow.demo.experiment import DEFAULT_SPEC, demo_config, local_dir
    from ppoflow.flows.demo import run_demo
    from ppoflow.flows.failure import terminal

    _prepare_run()
    with terminal(args.verbose), _interrupts(args, demo_config(local_dir(args.storage), DEFAULT_SPEC)):
        result = run_demo(args.storage, args.iterations, verbose=args.verbose)
    return 0 if result["ok"] else 1


def cmd_agent(args: argparse.Namespace) -> int:
    from ppoflow.infra.remote.agent.node_agent import run_agent

    return run_agent(args)


COMMANDS = {
    "demo": cmd_demo,
    "run": cmd_run,
    "status": cmd_status,
    "export-hf": cmd_export_hf,
    "rollback": cmd_rollback,
    "tensorboard": cmd_tensorboard,
    "agent": cmd_agent,
}


def _prepare_run() -> None:
    """Before a flow runs in this process: the temporary Prefect server (if one is needed) ends
    with this process and starts with a generous timeout, and sends no usage telemetry (offline
    machines log an error for it each run). Environment variables already set win."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's 20 s is too short for the temporary server's first start on a busy 2-core machine
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from ppoflow.flows.local_api import own_ephemeral_server

    own_ephemeral_server()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ppoflow`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command in ("demo", "run"):
        from ppoflow.flows.signals import exit_while_starting

        # before the heavy imports: until the run holds something, SIGTERM or Ctrl-C ends it at once
        exit_while_starting(args.command)
    try:
        return COMMANDS[args.command](args)
    except CLIError as err:
        print(f"ppoflow: error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `ppoflow status X | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
