"""A state of a committed iteration written out as a checkpoint, whether or not training wrote it.

``export-hf --iteration n``, ``ppoflow eval`` and the like read a committed state. A snapshot
iteration's is on storage; any other is rebuilt first: a worker group of the role (the model and
its optimizer, nothing else) loads the snapshot, replays the updates since (``RunGroups._load``,
:mod:`ppoflow.tasks.replay`) and saves the result where the caller says (a scratch place: the
experiment's own checkpoint directories stay training's).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from ppoflow.infra.checkpoint.marker import is_complete
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.remote.contracts import WorkerMode, trained_role
from ppoflow.infra.remote.driver.slots import device_slots
from ppoflow.tasks.run.context import open_run, worker_groups

__all__ = ["materialize_state", "BUILD_ROLES"]

#: What a group that only rebuilds a state builds: the trained model and its optimizer.
BUILD_ROLES: dict[str, WorkerMode] = {"actor": WorkerMode.ACTOR, "critic": WorkerMode.CRITIC}

_LOG = logging.getLogger("ppoflow.materialize")


class _Say:
    """A logger-shaped sink for the groups' notes (``info`` / ``warning``)."""

    def __init__(self, say: Callable[[str], None]):
        self.info = self.warning = say


def materialize_state(
    cfg: ExperimentConfig, role: str, state: str, out_url: str, say: Callable[[str], None] | None = None
) -> str:
    """Write ``role``'s ``state`` (a committed iteration's state URL) as a complete checkpoint at
    ``out_url``: copied from storage by loading it, or rebuilt by replay. Returns ``out_url``."""
    say = say or _LOG.info
    key = f"materialize-{uuid.uuid4().hex[:12]}"
    ctx = open_run(key, cfg, log=_Say(say), roles={role: BUILD_ROLES[role]})
    with ctx.storage, worker_groups(key), device_slots(cfg, say, run_id=key, wait_log=say):
        if not is_complete(state):
            say(f"{state} is not a snapshot: rebuilding it from the latest one")
        worker = ctx.groups.worker(trained_role(role), state, progress=say)
        worker.save_checkpoint(out_url, extra={"materialized_from": ctx.paths.ref(state)})
    return out_url
