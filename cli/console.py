"""What a terminal shows of a flow run: a line per committed iteration, and a summary at the end.

``ppoflow run`` and ``ppoflow demo`` run the ``ppo`` flow in this process through
:func:`run_with_progress` (which polls the experiment's manifest and prints ``headline_line``
for each new iteration) and then print :func:`print_summary`, or on failure
``ppoflow.cli.failure.print_failure``'s error block.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import evaluation_line, headline, headline_line

__all__ = ["run_with_progress", "print_summary", "deployment_config", "command"]


class _Progress(threading.Thread):
    """Prints ``headline_line`` for each iteration the flow commits (polls the manifest), and a
    note when nothing was committed for a while (:meth:`note`)."""

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
        self.before = self.shown
        self.last_news = time.monotonic()
        self.notes = 0  # notes printed since the last news
        self.next_note_s = quiet_s  # when the next one is due, in seconds after the last news

    def _committed(self) -> int:
        try:
            return int(storage.read_json(self.paths.manifest)["iteration"])
        except (OSError, ValueError, KeyError):  # not there yet, or a transient read error: next poll
            return self.shown

    @property
    def starting(self) -> bool:
        """True until the run commits its first iteration: the groups start, the models load, and
        on a GPU the first iteration also compiles and captures vLLM's graphs."""
        return self.shown == self.before

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
            self.notes, self.next_note_s = 0, self.quiet_s

    def run(self) -> None:
        while not self.stop_event.wait(self.poll_s):
            self.poll()
            line = self.note(time.monotonic())
            if line is not None:
                self.out(line)

    def note(self, now: float) -> str | None:
        """The note due at ``now`` (a ``time.monotonic()``), or None. While the run starts the
        notes say what is happening, at a rising interval (``quiet_s``, then twice as long as the
        interval before: 90 s, 270 s, 630 s, ...); once it has committed, a silence of ``quiet_s``
        since the last commit gets a note naming what the next iteration has finished, every
        ``quiet_s``."""
        quiet = now - self.last_news
        if quiet < self.next_note_s:
            return None
        self.notes += 1
        self.next_note_s += self.quiet_s * (2**self.notes if self.starting else 1)
        return self.quiet_line(quiet)

    def quiet_line(self, quiet_s: float | None = None) -> str:
        """What the run is waiting for after ``quiet_s`` (default: ``self.quiet_s``) without a
        commit: while it starts, what starting is; later the tasks of the next iteration that
        finished (their receipts), or none yet."""
        n = self.shown + 1
        quiet = self.quiet_s if quiet_s is None else quiet_s
        try:
            done = [
                name.removesuffix(".json")
                for name in storage.listdir(storage.join(self.paths.iteration(n), "tasks"))
            ]
        except (OSError, ValueError):  # no task of it finished yet (or a transient read error)
            done = []
        if self.starting:
            head = f"... {quiet:.0f} s into the run: iteration {n}, its first,"
            if not done:
                return (
                    f"{head} is starting: the worker groups start and load their models (on a GPU "
                    "vLLM also compiles and captures its graphs, a minute or more once per run), "
                    "unless the run waits for this machine's device slots (a warning above then "
                    "names the run that holds them)"
                )
            return (
                f"{head} has finished {', '.join(done)}; its next task is running (a worker "
                "group's first task also starts it)"
            )
        head = f"... no iteration committed for {quiet:.0f} s: iteration {n}"
        if not done:
            return f"{head} has no finished task yet (the Prefect UI shows the running task)"
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


def deployment_config(
    cfg: ExperimentConfig, config_path: str | None, overrides: Sequence[str] = (), recorded: str | None = None
) -> tuple[str | None, str]:
    """What ``prefect deployment run ppo/iteration -p config=...`` should be given to continue this
    experiment, and a note: ``(value or None, note)``. The deployment's flow runs in another
    process, in the working directory of ``prefect deploy``: a local path is given absolute; a run
    with ``--set`` overrides is continued from the config the experiment recorded (``recorded``:
    its URL), which holds them; a config in ``memory://`` cannot be read there (None)."""
    source = config_path
    note = ""
    if overrides or source is None:
        source = recorded
        if source is not None and overrides:
            note = "  (this run's config with its --set overrides, as the experiment recorded it)"
    if source is None:
        return None, "the experiment records no config: give the deployment your config's path or URL"
    protocol = storage.protocol_of(source)
    if protocol == "memory":
        return None, (
            f"the config is in memory ({source}), which a deployment's process cannot read: save it "
            "to a file or object storage and give that"
        )
    if protocol == "file":
        source = os.path.abspath(source.removeprefix("file://"))
    root = cfg.storage.root
    if storage.protocol_of(root) == "file" and not os.path.isabs(root.removeprefix("file://")):
        note += (
            f"  (storage.root {root!r} is relative: the deployment resolves it in the directory "
            "`prefect deploy` ran in)"
        )
    return source, note


def print_summary(
    cfg: ExperimentConfig,
    run: dict[str, Any],
    config_path: str | None = None,
    wall_s: float | None = None,
    out: Callable[[str], None] = print,
    overrides: Sequence[str] = (),
    verl: Sequence[str] = (),
) -> None:
    """Where the experiment lives, its reward trend, the plot, and the commands to go on (after a
    successful run; a failed one gets ``ppoflow.cli.failure.print_failure`` instead). ``config_path``
    and ``overrides``: the config file and the ``--set KEY=VALUE`` items the run was given; ``verl``:
    its ``--verl`` items (docs/verl.md)."""
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
    cfg_arg = shlex.quote(config_path) if config_path else ("" if verl else "<config.yaml>")
    sets = "".join(f" --set {shlex.quote(item)}" for item in overrides)
    sets += (" --verl " + " ".join(shlex.quote(item) for item in verl)) if verl else ""
    out(f"continue training: {ppoflow} run {cfg_arg} --iterations 20{sets}".replace("run  ", "run "))
    recorded = manifest.config_history[-1]["config"] if manifest and manifest.config_history else None
    source, note = deployment_config(
        cfg, config_path, [*overrides, *verl], paths.url(recorded) if recorded else None
    )
    deploy = f"{prefect} deploy -n iteration && {prefect} deployment run ppo/iteration"
    if source is None:
        out(f"   or deployment:  {deploy} -p config=<path or URL> -p iterations=20   (docs/deployments.md)")
        out(f"                   {note}")
    else:
        out(
            f"   or deployment:  {deploy} -p config={shlex.quote(source)} -p iterations=20   "
            f"(docs/deployments.md){note}"
        )
    out(
        f"export the policy: {ppoflow} export-hf {paths.root} {os.path.join(os.path.dirname(paths.root), 'export')}"
    )
