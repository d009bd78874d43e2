"""What a terminal shows of a flow run: a line per committed iteration, and a summary at the end.

``ppoflow run`` and ``ppoflow demo`` run the ``ppo`` flow in this process through
:func:`run_with_progress` (which polls the experiment's manifest and prints ``headline_line``
for each new iteration) and then print :func:`print_summary`, or on failure
``ppoflow.cli.failure.print_failure``'s error block.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import evaluation_line, headline, headline_line

__all__ = ["run_with_progress", "print_summary", "command"]


class _Progress(threading.Thread):
    """Prints ``headline_line`` for each iteration the flow commits (polls the manifest)."""

    def __init__(
        self, cfg: ExperimentConfig, out: Callable[[str], None], poll_s: float = 0.5, quiet_s: float = 90.0
    ):
        super().__init__(name="ppoflow-progress", daemon=True)
        from ppoflow.infra.experiment.manifest import ExperimentPaths

        self.paths, self.out, self.poll_s, self.quiet_s = ExperimentPaths.of(cfg), out, poll_s, quiet_s
        self.stop_event = threading.Event()
        self.zero_url = self.paths.file(0, "eval/val/metrics.json")
        self.zero_shown = False
        self.shown = 0
        self.shown = self._committed()  # iterations committed before this run are not shown
        self.last_news = time.monotonic()

    def _committed(self) -> int:
        try:
            return int(storage.read_json(self.paths.manifest)["iteration"])
        except (OSError, ValueError, KeyError):  # not there yet, or a transient read error: next poll
            return self.shown

    def poll(self) -> None:
        if self.shown == 0 and not self.zero_shown:  # a new experiment's base policy, evaluated
            try:
                zero = storage.read_json(self.zero_url)
            except (OSError, ValueError):
                zero = None
            if zero is not None:
                self.out(evaluation_line(0, zero, " (before training)"))
                self.zero_shown = True
        current = self._committed()
        while self.shown < current:
            n = self.shown + 1
            try:
                metrics = storage.read_json(self.paths.file(n, "metrics.json"))
            except (OSError, ValueError):  # a transient read error: next poll
                return
            self.out(headline_line(n, metrics))
            self.shown = n
            self.last_news = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            self.poll()
            if time.monotonic() - self.last_news > self.quiet_s:
                self.out(self.quiet_line())
                self.last_news = time.monotonic()

    def quiet_line(self) -> str:
        """What the run is waiting for when nothing was committed for ``quiet_s``: the tasks of the
        next iteration that finished (their receipts), or none yet."""
        n = self.shown + 1
        try:
            done = [
                name.removesuffix(".json")
                for name in storage.listdir(storage.join(self.paths.iteration(n), "tasks"))
            ]
        except (OSError, ValueError):  # no task of it finished yet (or a transient read error)
            done = []
        head = f"... no iteration committed for {self.quiet_s:.0f} s: iteration {n}"
        if not done:
            return (
                f"{head} has no finished task yet: still starting, or waiting for this machine's "
                "device slots (a warning above names the run that holds them)"
            )
        return (
            f"{head} has finished {', '.join(done)}; waiting for its next task or for its "
            "checkpoints' background writes (the Prefect UI shows the running task)"
        )

    def finish(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)
        self.poll()


def run_with_progress(
    cfg: ExperimentConfig, iterations: int, out: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the ``ppo`` flow in this process, printing a line per committed iteration.

    Returns ``{ok, result, error, exception, committed_before, flow_run_id, wall_s}``
    (``result``: what the flow returned; ``exception``: why it failed).
    """
    from ppoflow.flows.ppo import ppo

    progress = _Progress(cfg, out)
    before = progress.shown
    progress.start()
    started = time.time()
    try:
        state = ppo(cfg, iterations, return_state=True)
    finally:
        progress.finish()
    ok = state.is_completed()
    result = state.result(raise_on_failure=False)
    return {
        "ok": ok,
        "result": result if ok else None,
        "error": None if ok else f"{state.name}: {result}",
        "exception": result if isinstance(result, BaseException) else None,
        "committed_before": before,
        "flow_run_id": str(state.state_details.flow_run_id),
        "wall_s": time.time() - started,
    }


def command(name: str) -> str:
    """How to call the console script ``name`` of this environment from the user's shell: the bare
    name when it is on PATH, else its path (e.g. ``.venv/bin/prefect`` after ``make demo``)."""
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), name)
    found = shutil.which(name)
    if not os.path.exists(here) or (found and os.path.realpath(found) == os.path.realpath(here)):
        return name
    rel = os.path.relpath(here)
    return rel if not rel.startswith("..") else here


def _ui_hint(flow_run_id: str | None) -> list[str]:
    from ppoflow.cli.local_api import local_server

    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    path = f"/runs/flow-run/{flow_run_id}" if flow_run_id else "/runs"
    server = local_server()
    if api and (server is None or server.url is None or api != server.url.rstrip("/")):
        ui = api[:-4] if api.endswith("/api") else api
        return [f"Prefect UI:        {ui}{path}"]
    return [
        f"Prefect UI:        {command('prefect')} server start      (this run is in the local Prefect database)",
        f"                   then open http://127.0.0.1:4200{path}",
    ]


def trend_lines(trend: list[dict[str, Any]]) -> list[str]:
    """The training score's and the held-out score's first and last values over ``trend``."""
    lines = []
    for name, label, what in (
        ("score", "score:", "mean score of the reward function on the training rollouts"),
        ("val", "held-out score:", "evaluation of data.val_files"),
    ):
        h = headline(name)
        rows = [r for r in trend if h.key_in(r)]
        if rows:
            first, last = rows[0], rows[-1]
            a, b = h.value(first), h.value(last)
            lines.append(
                f"{label:<18} iteration {first['iteration']}: {a:.3f} -> iteration {last['iteration']}: "
                f"{b:.3f}   (difference {b - a:+.3f}; {what})"
            )
    return lines


def print_summary(
    cfg: ExperimentConfig,
    run: dict[str, Any],
    config_path: str | None = None,
    wall_s: float | None = None,
    out: Callable[[str], None] = print,
) -> None:
    """Where the experiment lives, its reward trend, the plot, and the commands to go on (after a
    successful run; a failed one gets ``ppoflow.cli.failure.print_failure`` instead)."""
    from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

    paths = ExperimentPaths.of(cfg)
    manifest = read_manifest(paths)
    wall = run["wall_s"] if wall_s is None else wall_s
    out("")
    out(f"experiment:        {paths.root}   (iteration {manifest.iteration if manifest else 0} committed)")
    for line in trend_lines(manifest.trend if manifest else []):
        out(line)
    out(f"wall time:         {wall:.0f} s ({wall / 60:.1f} min)")
    plot = storage.join(paths.root, "plots", "metrics.png")
    if storage.exists(plot):
        out(f"plot:              {plot}")
    ppoflow, prefect = command("ppoflow"), command("prefect")
    out(f"metrics:           {paths.root}/iterations/<n>/metrics.json   ({ppoflow} status {paths.root})")
    out(
        f"TensorBoard:       {ppoflow} tensorboard {paths.root} && {command('tensorboard')} --logdir "
        f"{paths.root}/tensorboard"
    )
    for line in _ui_hint(run.get("flow_run_id")):
        out(line)
    cfg_arg = config_path or "<config.yaml>"
    out(f"continue training: {ppoflow} run {cfg_arg} --iterations 20")
    out(
        f"   or deployment:  {prefect} deploy -n iteration && {prefect} deployment run ppo/iteration "
        "-p iterations=20   (docs/deployments.md)"
    )
    out(
        f"export the policy: {ppoflow} export-hf {paths.root} {os.path.join(os.path.dirname(paths.root), 'export')}"
    )
