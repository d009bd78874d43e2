"""Optional Weights & Biases tracking of an experiment (``tracking.wandb``), beside MLflow's.

Off unless the config sets ``tracking.wandb`` with a mode other than ``disabled``; ``wandb`` is
imported only then (``pip install 'ppoflow[wandb]'``; a config that needs it and a machine without
it fail in the preflight, :func:`wandb_problems`). Each experiment is one W&B run:

    config   the config flattened as MLflow's params (``actor.optim.lr``, ...), numbers kept as
             numbers; a later flow run's changed settings replace the old values
    metrics  every finite number of each committed iteration's ``metrics.json`` (a held-out
             evaluation's ``val/*`` included) and ``iteration``; iteration 0's evaluation (the base
             policy's) at step 0
    tables   ``samples``: the iteration's first rollouts (``iterations/<n>/samples.json``, the rows
             of the Prefect table artifact); ``eval/samples``: an evaluation's first generations

The run's id is made once, ``<experiment>-<8 hex digits>``, and kept in ``<experiment>/wandb.json``
with the last step logged: every later flow run of the experiment resumes that run
(``resume="allow"``); an experiment removed and started again under its name, or copied under
another name, gets a new run.

W&B refuses a step below one it has: iteration n goes to step ``max(n, last step + 1)``, which is n
unless iteration n is committed again after a rollback; then it lands after everything logged
before, its ``iteration`` saying which it is (W&B's charts can use it as their x-axis).

Where the run's files go (``<dir>/wandb/``): ``tracking.wandb.dir``; else W&B's own ``WANDB_DIR``;
else the experiment's directory when the storage is local (offline runs stay with the experiment
and ``wandb sync <experiment>/wandb/offline-run-*`` uploads them all); else (S3) the working
directory's ``./wandb``. A tracking failure never fails training: the first is one warning, and
W&B is off for the rest of that flow run.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable
from typing import Any

from ppoflow.infra.config import ExperimentConfig, WandbConfig
from ppoflow.infra.config.tracking import WANDB_API_KEY_ENV
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.evaluation import EVAL_DIR, VAL_TAG
from ppoflow.infra.experiment.metrics import finite_scalars
from ppoflow.infra.experiment.paths import ExperimentPaths
from ppoflow.infra.experiment.tracking import SAMPLES_FILE, Guarded, flat_config

__all__ = ["RUN_FILE", "WandbTracker", "new_run_id", "next_step", "run_dir", "wandb_problems"]

#: ``<experiment>/wandb.json``: ``{id, experiment, project, entity, step, iteration}`` (the last
#: step logged, and its iteration)
RUN_FILE = "wandb.json"
_NAME_CHARS = 48  # of the experiment's name in a run id (W&B ids stay short; 8 random hex follow)
_TEXT = 2000  # characters of a prompt or response in a table


def new_run_id(experiment: str) -> str:
    """A new W&B run id for ``experiment`` (its name is already made of characters W&B allows)."""
    return f"{experiment[:_NAME_CHARS]}-{uuid.uuid4().hex[:8]}"


def next_step(iteration: int, last_step: int, run_step: int = 0) -> int:
    """The W&B step of ``iteration``: itself, unless W&B already has that step or a later one
    (``last_step``, kept in ``wandb.json``; ``run_step``, the run's own counter once resumed)."""
    return max(iteration, last_step + 1, run_step)


def run_dir(wb: WandbConfig, root: str, storage_options: dict | None = None) -> str | None:
    """The directory W&B writes the run's files under (module docstring); None: W&B's default."""
    if wb.dir:
        return os.path.abspath(os.path.expanduser(wb.dir))
    if os.environ.get("WANDB_DIR"):
        return None
    fs, path = storage.url_to_fs(root, storage_options=storage_options)
    return path if storage.is_local(fs) else None


def wandb_problems(cfg: ExperimentConfig) -> list[tuple[str, str, str]]:
    """Why ``tracking.wandb`` cannot run here, as preflight problems ``(where, found, fix)``."""
    wb = cfg.tracking.wandb
    if wb is None or wb.mode == "disabled":
        return []
    where = f"tracking.wandb (mode: {wb.mode})"
    out = []
    if not _installed("wandb"):
        out.append(
            (
                where,
                "the wandb package is not installed in the environment that runs the flows",
                "pip install 'ppoflow[wandb]' there, or remove tracking.wandb (or set its mode: disabled)",
            )
        )
    if wb.mode == "online" and not os.environ.get(WANDB_API_KEY_ENV):
        out.append(
            (
                where,
                f"{WANDB_API_KEY_ENV} is not set in the environment of the process that runs the flows",
                f"export {WANDB_API_KEY_ENV} (https://wandb.ai/authorize) there before starting the "
                "worker or `ppoflow run`; or mode: offline, and `wandb sync` the run later",
            )
        )
    where_dir = wb.dir and os.path.abspath(os.path.expanduser(wb.dir))
    if where_dir and not _creatable(where_dir):
        out.append(
            (f"tracking.wandb.dir={wb.dir}", f"{where_dir} cannot be written", "give a writable directory")
        )
    return out


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that does not import; a module without a spec
        return False


def _creatable(path: str) -> bool:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


class WandbTracker(Guarded):
    """The W&B run of one experiment (``root``: the experiment's URL), with
    :class:`~ppoflow.infra.experiment.tracking.MlflowTracker`'s methods; each swallows tracking
    failures (module docstring). :meth:`of` returns None when W&B is off."""

    def __init__(self, cfg: ExperimentConfig, root: str, warn: Callable[[str], None]):
        import wandb  # only here: a run without W&B never imports it

        assert cfg.tracking.wandb is not None
        self.wandb, self.wb, self.warn = wandb, cfg.tracking.wandb, warn
        self.label = "W&B tracking"
        self.paths = ExperimentPaths(root)
        self.name = cfg.storage.experiment
        self.dir = run_dir(self.wb, root, cfg.storage.storage_options)
        self.rows = cfg.evaluation.samples_shown
        self.run: Any = None
        self.record: dict[str, Any] = {}
        self.failed = False

    @classmethod
    def of(cls, cfg: ExperimentConfig, root: str, warn: Callable[[str], None]) -> WandbTracker | None:
        """A tracker when ``tracking.wandb`` is on, else None (and None, with a warning, when the
        preflight's problems were not fixed: the flow run goes on without W&B)."""
        wb = cfg.tracking.wandb
        if wb is None or wb.mode == "disabled":
            return None
        problems = wandb_problems(cfg)
        if problems:
            warn(f"W&B tracking is off: {problems[0][1]} ({problems[0][2]})")
            return None
        try:
            return cls(cfg, root, warn)
        except Exception as exc:  # noqa: BLE001 - tracking never fails training
            warn(f"W&B tracking cannot start ({type(exc).__name__}: {str(exc)[:300]}); not tracking")
        return None

    # -- the run -------------------------------------------------------------------------------

    def _run_file(self) -> str:
        return storage.join(self.paths.root, RUN_FILE)

    def _open(self) -> Any:
        """The experiment's W&B run: the one ``wandb.json`` names (resumed), or a new one."""
        if self.run is not None:
            return self.run
        url = self._run_file()
        self.record = storage.read_json(url) if storage.exists(url) else {}
        if not self.record.get("id") or self.record.get("experiment") != self.name:
            # a new run (kept before it starts: a crash cannot orphan the id); a copy of the
            # experiment under another name is another experiment, and gets a run of its own
            self.record = {
                "id": new_run_id(self.name),
                "experiment": self.name,
                "step": -1,
                "iteration": None,
            }
        self.record.update(project=self.wb.project, entity=self.wb.entity)
        storage.write_json_atomic(url, self.record)
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self.run = self.wandb.init(
            project=self.wb.project,
            entity=self.wb.entity,
            id=self.record["id"],
            resume="allow",
            mode=self.wb.mode,
            dir=self.dir,
            name=self.wb.name or self.name,
            group=self.wb.group,
            tags=self.wb.tags or None,
            notes=self.wb.notes,
            reinit="create_new",  # runs of other experiments in this process are theirs to finish
            settings=self.wandb.Settings(console="off"),  # the flow's logs are Prefect's
        )
        return self.run

    def start(self, config: dict[str, Any]) -> None:
        """Open (or resume) the run, record ``config`` (a ``model_dump(mode="json")``), and, on a
        run that has no step yet, iteration 0's evaluation at step 0."""
        self._guard("start", lambda: self._start(config))

    def _start(self, config: dict[str, Any]) -> None:
        run = self._open()
        run.config.update(flat_config(config), allow_val_change=True)
        zero = self.paths.file(0, f"{EVAL_DIR}/{VAL_TAG}")
        if int(self.record.get("step", -1)) < 0 and storage.exists(storage.join(zero, "metrics.json")):
            self._log_iteration(0, storage.read_json(storage.join(zero, "metrics.json")), zero)

    def finish(self, ok: bool = True) -> None:
        """End the flow run's part of the run (the next flow run resumes it)."""
        if self.run is not None:
            run, self.run = self.run, None
            self._guard("finish", lambda: run.finish(exit_code=0 if ok else 1))

    # -- per iteration -------------------------------------------------------------------------

    def log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None = None) -> None:
        """Iteration ``n``'s metrics and tables at its step (module docstring)."""
        self._guard(f"iteration {n}", lambda: self._log_iteration(n, metrics, eval_dir))

    def _log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None) -> None:
        run = self._open()
        step = next_step(n, int(self.record.get("step", -1)), int(run.step or 0))
        data: dict[str, Any] = {**finite_scalars(metrics), "iteration": n}
        samples = self.paths.file(n, SAMPLES_FILE)
        if self.rows and storage.exists(samples):
            data["samples"] = self._table(storage.read_json(samples))
        if self.rows and eval_dir is not None and storage.exists(storage.join(eval_dir, "generations.arrow")):
            data["eval/samples"] = self._table(self._generations(storage.join(eval_dir, "generations.arrow")))
        run.log(data, step=step)
        self.record.update(step=step, iteration=n)
        storage.write_json_atomic(self._run_file(), self.record)

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        names = list(dict.fromkeys(k for row in rows for k in row))
        columns: list[str | int] = [*names]  # what wandb.Table's annotation asks for
        return self.wandb.Table(columns=columns, data=[[row.get(c) for c in names] for row in rows])

    def _generations(self, url: str) -> list[dict[str, Any]]:
        from ppoflow.infra.data.dataproto import DataProto

        nt = DataProto.load(
            url, columns=["index", "data_source", "prompt", "response", "score"]
        ).non_tensor_batch
        return [
            {
                "index": int(nt["index"][i]),
                "data_source": str(nt["data_source"][i]),
                "prompt": str(nt["prompt"][i])[:_TEXT],
                "response": str(nt["response"][i])[:_TEXT],
                "score": float(nt["score"][i]),
            }
            for i in range(min(self.rows, len(nt["score"])))
        ]

    def log_file(self, url: str, artifact_path: str | None = None) -> None:
        """Nothing: the one file the flows send, the metrics plot, is what W&B draws itself."""
