"""Optional MLflow tracking of an experiment: metrics, config, plot, evaluations, promotions.

Off unless ``MLFLOW_TRACKING_URI`` is set (an ``http(s)://`` MLflow server, or a ``file://``
store that needs no server) and the MLflow client is installed (``pip install 'ppoflow[mlflow]'``,
the ``mlflow-skinny`` package). Then each experiment is one MLflow run in the MLflow experiment of
the same name:

    params      the config, flattened (``actor.optim.lr``, ...); a later run's changed settings
                become tags ``config.<key>`` (MLflow params cannot change)
    metrics     every finite numeric metric of each committed iteration, step = the iteration
                (names MLflow refuses a character of are written with ``_``: ``@`` -> ``_at_``)
    artifacts   ``plots/metrics.png`` (after each flow run), ``eval/<n:06d>/val/`` (the held-out
                evaluation's ``metrics.json`` and ``generations.arrow`` of iteration n),
                ``config/config.json``, ``promotions/<n:06d>/`` (a promoted HF directory)
    registry    each promotion, a version of the registered model of the experiment's name,
                tagged ``iteration``, ``metric``, ``value`` and ``metric.<name>`` per metric

The run's id is kept in ``<experiment>/mlflow.json`` (with the tracking URI), so every flow run of
the experiment continues the same MLflow run. A tracking failure (server down, refused request)
never fails training: the first one is logged as one warning and tracking is off for the rest of
that flow run (MLflow's client retries a request ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times first:
2 unless set, each waiting up to ``MLFLOW_HTTP_REQUEST_TIMEOUT``, 60 s unless set).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.metrics import finite_scalars

__all__ = [
    "Guarded",
    "ENV",
    "RUN_FILE",
    "SAMPLES_FILE",
    "MlflowTracker",
    "metric_name",
    "flatten",
    "flat_config",
]

ENV = "MLFLOW_TRACKING_URI"
#: ``<experiment>/mlflow.json``: ``{tracking_uri, experiment_id, run_id}``
RUN_FILE = "mlflow.json"
#: ``iterations/<n>/samples.json``: the rows of iteration n's table of its first rollouts (the
#: ``advantage`` task's Prefect table artifact), which W&B gets as a table
SAMPLES_FILE = "samples.json"
_BATCH = 900  # MLflow takes at most 1000 metrics / 100 params per log_batch request
_PARAM_MAX = 6000


def metric_name(key: str) -> str:
    """``key`` as an MLflow metric name (``val/x/pass@4`` -> ``val/x/pass_at_4``)."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


def flat_config(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config dump as ``{"a.b.c": value}``: the keys every tracker gets, the values as they are."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat_config(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): tree}


def flatten(tree: Any) -> dict[str, str]:
    """A config dump as MLflow's params, ``{"a.b.c": "value"}`` (lists and None as their text)."""
    return {key: str(value)[:_PARAM_MAX] for key, value in flat_config(tree).items()}


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {metric_name(k): v for k, v in finite_scalars(metrics).items()}


class Guarded:
    """What a tracker's calls share: the first failure warns once, naming ``label`` and the call,
    and turns the tracker off for the rest of the run (tracking never fails training)."""

    label = "tracking"
    failed = False
    warn: Callable[[str], None]

    def _guard(self, what: str, fn: Callable[[], Any]) -> Any:
        if self.failed:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - tracking never fails training
            self.failed = True
            self.warn(
                f"{self.label} failed ({what}: {type(exc).__name__}: {str(exc)[:300]}); "
                "no more of it in this run, training goes on"
            )
            return None


class MlflowTracker(Guarded):
    """The MLflow run of one experiment (``root``: the experiment's URL). Every method swallows
    tracking failures (see the module docstring); :meth:`of` returns None when tracking is off."""

    def __init__(self, uri: str, root: str, name: str, warn: Callable[[str], None], storage_options=None):
        from mlflow.tracking import MlflowClient, set_registry_uri, set_tracking_uri

        # MLflow resolves some calls (a model version's source on a file store) through the
        # process's default URI, which would otherwise create ./mlflow.db in the working directory
        set_tracking_uri(uri)
        set_registry_uri(uri)
        self.uri, self.root, self.name, self.warn = uri, root.rstrip("/"), name, warn
        self.label = f"MLflow tracking at {uri}"
        self.storage_options = storage_options
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        self.run_id: str | None = None
        self.created = False  # this tracker made the run (not continued from mlflow.json)
        self.failed = False

    @classmethod
    def of(
        cls, root: str, name: str, warn: Callable[[str], None], uri: str | None = None
    ) -> MlflowTracker | None:
        """A tracker when ``uri`` (default: ``$MLFLOW_TRACKING_URI``) is set, else None."""
        uri = uri or os.environ.get(ENV) or None
        if not uri:
            return None
        # MLflow's own defaults (7 retries with backoff, 120 s per request) could hold a commit up
        # for minutes when the server is down; a user's settings of these are kept
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        try:
            return cls(uri, root, name, warn)
        except ImportError:
            warn(f"{ENV}={uri} but the MLflow client is missing: pip install 'ppoflow[mlflow]'; not tracking")
        except Exception as exc:  # noqa: BLE001 - tracking never fails training
            warn(
                f"MLflow tracking at {uri} cannot start ({type(exc).__name__}: {str(exc)[:300]}); not tracking"
            )
        return None

    # -- the run -----------------------------------------------------------------------------

    def _run_file(self) -> str:
        return storage.join(self.root, RUN_FILE)

    def _open(self) -> str:
        """The experiment's MLflow run: the one ``mlflow.json`` names, or a new one."""
        if self.run_id is not None:
            return self.run_id
        url = self._run_file()
        known = storage.read_json(url) if storage.exists(url) else None
        if known and known.get("tracking_uri") == self.uri:
            try:
                run = self.client.get_run(known["run_id"])
            except Exception:  # noqa: BLE001 - deleted or unknown: a new run below
                run = None
            if run is not None and run.info.lifecycle_stage == "active":
                self.run_id = run.info.run_id
                return self.run_id
        exp = self.client.get_experiment_by_name(self.name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.name)
        run = self.client.create_run(exp_id, run_name=self.name, tags={"ppoflow.experiment_url": self.root})
        self.run_id, self.created = run.info.run_id, True
        storage.write_json_atomic(
            url, {"tracking_uri": self.uri, "experiment_id": exp_id, "run_id": self.run_id}
        )
        return self.run_id

    def start(self, config: dict[str, Any]) -> None:
        """Open (or continue) the run and record ``config`` (a ``model_dump(mode="json")``)."""
        self._guard("start", lambda: self._start(config))

    def _start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag

        run_id = self._open()
        run = self.client.get_run(run_id)
        if run.info.status != "RUNNING":  # a later flow run of the experiment continues it
            self.client.update_run(run_id, status="RUNNING")
        have = run.data.params
        params = flatten(config)
        new = [Param(k, v) for k, v in sorted(params.items()) if k not in have]
        changed = [RunTag(f"config.{k}", v) for k, v in sorted(params.items()) if k in have and have[k] != v]
        for i in range(0, len(new), 100):
            self.client.log_batch(run_id, params=new[i : i + 100])
        if changed:
            self.client.log_batch(run_id, tags=changed)
        self.client.log_dict(run_id, config, "config/config.json")

    def finish(self, ok: bool = True) -> None:
        """Mark the run finished (or failed) at the end of a flow run; the next one reopens it."""
        if self.run_id is not None:
            run_id = self.run_id
            self._guard("finish", lambda: self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED"))

    # -- per iteration -------------------------------------------------------------------------

    def log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None = None) -> None:
        """Iteration ``n``'s metrics at step n, and the files of its evaluation at ``eval_dir``."""
        self._guard(f"iteration {n}", lambda: self._log_iteration(n, metrics, eval_dir))

    def _log_iteration(self, n: int, metrics: dict[str, Any], eval_dir: str | None) -> None:
        from mlflow.entities import Metric

        run_id = self._open()
        stamp = metrics.get("timestamp")
        ms = int(float(stamp) * 1000) if isinstance(stamp, (int, float)) else int(time.time() * 1000)
        rows = [Metric(k, v, ms, n) for k, v in sorted(_numbers(metrics).items())]
        for i in range(0, len(rows), _BATCH):
            self.client.log_batch(run_id, metrics=rows[i : i + _BATCH])
        if eval_dir is not None and storage.exists(eval_dir):
            self._upload(eval_dir, f"eval/{n:06d}/{eval_dir.rstrip('/').rsplit('/', 1)[-1]}")

    def log_file(self, url: str, artifact_path: str | None = None) -> None:
        """One file (any fsspec URL) as an artifact under ``artifact_path``."""
        self._guard(f"artifact {url}", lambda: self._upload(url, artifact_path, single=True))

    def _upload(self, url: str, artifact_path: str | None, single: bool = False) -> None:
        run_id = self._open()
        fs, path = storage.url_to_fs(url, storage_options=self.storage_options)
        if storage.is_local(fs):
            if single:
                self.client.log_artifact(run_id, path, artifact_path)
            else:
                self.client.log_artifacts(run_id, path, artifact_path)
            return
        with tempfile.TemporaryDirectory(prefix="ppoflow-mlflow-") as tmp:
            local = os.path.join(tmp, path.rstrip("/").rsplit("/", 1)[-1])
            fs.get(path, local, recursive=not single)
            if single:
                self.client.log_artifact(run_id, local, artifact_path)
            else:
                self.client.log_artifacts(run_id, local, artifact_path)

    # -- promotions ----------------------------------------------------------------------------

    def register_promotion(self, record: dict[str, Any], model_dir: str) -> str | None:
        """Upload the promoted HF directory ``model_dir`` and register it as a version of the
        model named after the experiment; returns the version (None when tracking failed)."""
        n = int(record["iteration"])
        return self._guard(f"promotion of iteration {n}", lambda: self._register(record, model_dir))

    def _register(self, record: dict[str, Any], model_dir: str) -> str:
        from mlflow.exceptions import MlflowException

        run_id = self._open()
        n = int(record["iteration"])
        path = f"promotions/{n:06d}"
        self.client.log_artifacts(run_id, model_dir, path)
        try:
            self.client.create_registered_model(self.name, description=f"ppoflow experiment {self.root}")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        tags = {"iteration": str(n), "seq": str(record.get("seq")), "metric": str(record.get("metric"))}
        tags["value"] = str(record.get("value"))
        for key, value in _numbers(record.get("metrics") or {}).items():
            tags[f"metric.{key}"] = repr(value)
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{path}"
        version = self.client.create_model_version(self.name, source, run_id=run_id, tags=tags)
        if self.created:  # a promotion of an experiment no tracked flow ran: its run ends here
            self.client.set_terminated(run_id, "FINISHED")
        return str(version.version)
