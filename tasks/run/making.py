"""How a flow run makes its worker groups (:class:`~ppoflow.tasks.run.groups.RunGroups` holds them):
the worker class of each role, its ranks' environment, the connect timeout, where the ranks run.

With ``resources.launch: rendezvous`` the groups' ranks run on ``rendezvous.nnodes`` nodes: the
run opens its :class:`~ppoflow.infra.remote.driver.hub.ClusterHub` (the control endpoint the
nodes' ``ppoflow agent`` processes dial, and the c10d rendezvous store) with the first group,
gives every group (and every rebuild) its own rendezvous id ``<run>-<role>-<start>`` and a scratch
space under ``<experiment>/scratch/``, and closes the hub after the groups at the end of the run.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.config.system import DETERMINISTIC_ENV
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.infra.models.rollout_engines import engine_spec
from ppoflow.infra.remote.cluster_key import load_cluster_key
from ppoflow.infra.remote.contracts import ROLES, Build, WorkerMode
from ppoflow.infra.remote.driver.group import WorkerGroup
from ppoflow.infra.remote.driver.hub import ClusterHub
from ppoflow.infra.remote.driver.launchers import Launcher
from ppoflow.infra.remote.driver.rendezvous import RendezvousLauncher
from ppoflow.infra.remote.procs import PRELOAD_ENV
from ppoflow.infra.runtime import faults

__all__ = ["GroupMaker", "WORKERS", "DEFAULT_BUILDS", "connect_timeout_s"]

#: The worker class of each group (imported in the ranks only), by the name tasks use for it
#: (:data:`~ppoflow.infra.remote.contracts.ROLES`: each group's contract).
WORKERS: dict[str, str] = {name: role.worker for name, role in ROLES.items()}
#: What each group's worker builds unless a run says otherwise.
DEFAULT_BUILDS: dict[str, Build] = {name: role.default for name, role in ROLES.items()}


def connect_timeout_s(cfg: ExperimentConfig) -> float:
    """How long a group's start waits for its ranks to connect: ``resources.connect_timeout_s``;
    across nodes at least ``rendezvous.join_timeout_s`` (the agents join the rendezvous first)."""
    res = cfg.resources
    if res.launch == "rendezvous":
        return max(res.connect_timeout_s, res.rendezvous.join_timeout_s)
    return res.connect_timeout_s


class GroupMaker:
    """Makes the groups of flow run ``key`` (not started); owns the run's cluster hub."""

    def __init__(
        self,
        key: str,
        cfg: ExperimentConfig,
        paths: ExperimentPaths,
        emit: Callable[[str, str], None],
        log: Any,
    ):
        self.key, self.cfg, self.paths = key, cfg, paths
        self._emit, self.log = emit, log
        self._hub: ClusterHub | None = None
        self._hub_lock = threading.Lock()

    def group(self, role: str, build: Build | WorkerMode | str, start: int) -> WorkerGroup:
        """A new (not started) group of ``role`` whose worker builds ``build``, its ``start``-th in
        this run (ValueError for a mode ``role``'s worker does not have)."""
        cfg, build = self.cfg, ROLES[role].build(build)
        env = self.rank_env()
        preload = engine_spec(cfg.rollout.engine).preload if build.mode.builds_rollout else ()
        if preload:  # the launcher of a CPU group imports them once for its ranks
            env[PRELOAD_ENV] = ",".join(preload)
        return WorkerGroup(
            WORKERS[role],
            nprocs=cfg.resources.nprocs,
            config={"config": cfg.model_dump(mode="json"), "role": build.wire},
            device=cfg.resources.device,
            log=lambda line: self._emit(role, line),
            env=env,
            launcher=self._launcher(role, start),
            start_timeout_s=connect_timeout_s(cfg),
        )

    def _launcher(self, role: str, start: int) -> Launcher | None:
        """None (a local group) or the rendezvous launcher of ``role``'s ``start``-th group."""
        res = self.cfg.resources
        if res.launch == "local":
            return None
        gid = f"{self.key.replace('-', '')[:8]}-{role.replace('_', '')}-{start}"
        return RendezvousLauncher(
            self.cluster_hub(),
            res.rendezvous.nproc_per_node,
            gid,
            storage.join(self.paths.root, "scratch", gid),
            join_timeout_s=res.rendezvous.join_timeout_s,
        )

    def cluster_hub(self) -> ClusterHub:
        """The run's control endpoint for node agents (opened on first use)."""
        with self._hub_lock:
            if self._hub is None:
                nodes = self.cfg.resources.rendezvous
                self._hub = ClusterHub(
                    load_cluster_key(who="a flow run with resources.launch: rendezvous"),
                    nnodes=nodes.nnodes,
                    advertise_host=nodes.driver_host or socket.getfqdn(),
                    bind_host=nodes.bind_host,
                    control_port=nodes.control_port,
                    rdzv_port=nodes.rdzv_port,
                    log=lambda line: self._emit("", line),
                )
                self.log.info(
                    f"waiting for {nodes.nnodes} node agents: run `ppoflow agent --driver "
                    f"{self._hub.control_address} --node-rank N` on each node (c10d rendezvous store "
                    f"at {self._hub.rdzv_endpoint})"
                )
            return self._hub

    def rank_env(self) -> dict[str, str]:
        """The ranks' extra environment: fault drills, threads per rank, visible devices, deterministic kernels."""
        env = faults.rank_fault_env()
        if self.cfg.resources.threads_per_rank:
            env["PPOFLOW_RANK_THREADS"] = str(self.cfg.resources.threads_per_rank)
        if self.cfg.resources.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cfg.resources.visible_devices
        if self.cfg.resources.deterministic:
            env.update(DETERMINISTIC_ENV)
        return env

    def close(self) -> None:
        """Close the cluster hub, if one was opened (after the groups: the agents kill anything
        left and wait for the next run)."""
        with self._hub_lock:
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()
