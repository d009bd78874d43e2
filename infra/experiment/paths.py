"""Where everything of one experiment lives: :class:`ExperimentPaths`, the URLs under
``<storage.root>/<storage.experiment>/`` (the layout is :mod:`ppoflow.infra.experiment.manifest`'s
docstring), joined so that nothing resolves outside the experiment."""

from __future__ import annotations

from typing import overload

from ppoflow.infra.config import ConfigError, ExperimentConfig
from ppoflow.infra.data import storage

__all__ = ["ExperimentPaths", "OutsideExperiment", "LAYOUT"]


class OutsideExperiment(ConfigError):
    """A path that would resolve outside the storage root or the experiment: an experiment name
    that is not one directory (a config that bypassed validation), or a stored reference with a
    ``..`` component (not one ppoflow wrote)."""


#: What an experiment directory holds (the module docstring; ``data/`` is
#: :mod:`ppoflow.infra.data.stream`'s, ``scratch/`` a multi-node run's and an export's, ``promoted*``
#: and ``promotions/`` :mod:`ppoflow.infra.experiment.promotion`'s, ``mlflow.json``
#: :mod:`ppoflow.infra.experiment.tracking`'s, ``wandb.json`` and ``wandb/`` (W&B's run files)
#: :mod:`ppoflow.infra.experiment.wandb_tracking`'s, ``tensorboard/`` ``ppoflow tensorboard``'s,
#: ``queue/`` asynchronous training's, :mod:`ppoflow.infra.queue`).
LAYOUT = frozenset(
    {
        "manifest.json",
        "lock.json",
        "configs",
        "iterations",
        "checkpoints",
        "data",
        "plots",
        "scratch",
        "promoted",
        "promoted.json",
        "promotions",
        "mlflow.json",
        "wandb.json",
        "wandb",
        "tensorboard",
        "queue",
    }
)


class ExperimentPaths:
    """URLs of everything in one experiment (``experiment_url`` = storage root + experiment).

    Every URL is joined inside the experiment (:func:`~ppoflow.infra.data.storage.join_inside`):
    nothing derived from the config or from a stored reference resolves outside it
    (:class:`OutsideExperiment`)."""

    def __init__(self, experiment_url: str):
        self.root = experiment_url.rstrip("/")

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> ExperimentPaths:
        """The experiment of ``cfg``: ``storage.experiment``, one directory under ``storage.root``."""
        name = cfg.storage.experiment
        if not name or "/" in name or "\\" in name:
            raise OutsideExperiment(
                f"storage.experiment={name!r}: an experiment is one directory under storage.root; "
                "give a name without '/'"
            )
        try:
            return cls(storage.join_inside(cfg.storage.root.rstrip("/") or "/", name))
        except ValueError as err:
            raise OutsideExperiment(f"storage.experiment={name!r}: {err}; give a plain name") from None

    def _join(self, *parts: str) -> str:
        try:
            return storage.join_inside(self.root, *parts)
        except ValueError as err:
            raise OutsideExperiment(f"{err}; a reference under the experiment cannot hold '..'") from None

    @overload
    def ref(self, url: str) -> str: ...
    @overload
    def ref(self, url: None) -> None: ...
    @overload
    def ref(self, url: str | None) -> str | None: ...
    def ref(self, url: str | None) -> str | None:
        """``url`` relative to the experiment root, as stored in manifests and receipts (so an
        experiment directory can be copied or moved, e.g. from local disk to S3)."""
        if url is None:
            return None
        prefix = self.root + "/"
        return url[len(prefix) :] if url.startswith(prefix) else url

    @overload
    def url(self, ref: str) -> str: ...
    @overload
    def url(self, ref: None) -> None: ...
    @overload
    def url(self, ref: str | None) -> str | None: ...
    def url(self, ref: str | None) -> str | None:
        """The URL of a stored reference (see :meth:`ref`); a relative one stays inside the
        experiment (:class:`OutsideExperiment` if it has a ``..`` component)."""
        if ref is None or "://" in ref or ref.startswith("/"):
            return ref
        return self._join(ref)

    @property
    def manifest(self) -> str:
        return self._join("manifest.json")

    @property
    def lock(self) -> str:
        return self._join("lock.json")

    def config(self, config_hash: str) -> str:
        return self._join("configs", f"{config_hash}.yaml")

    def iteration(self, n: int) -> str:
        return self._join("iterations", f"{n:06d}")

    def file(self, n: int, name: str) -> str:
        """``iterations/{n:06d}/<name>`` (e.g. ``rollout.arrow``, ``metrics.json``)."""
        return self._join("iterations", f"{n:06d}", name)

    def receipt(self, n: int, task: str) -> str:
        return self._join("iterations", f"{n:06d}", "tasks", f"{task}.json")

    def checkpoint(self, role: str, n: int) -> str:
        """``checkpoints/<role>/{n:06d}`` (role: actor or critic)."""
        return self._join("checkpoints", role, f"{n:06d}")
