"""Where and how a run runs: storage, checkpoints, and the ranks (one host or a rendezvous)."""

from __future__ import annotations

import os
import sys
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ppoflow.infra.config.names import NAME_PATTERN, NAME_RULE, Section, name_problem

__all__ = [
    "StorageConfig",
    "RendezvousConfig",
    "CheckpointConfig",
    "ResourcesConfig",
    "DETERMINISTIC_ENV",
    "ROOT_ENTRIES",
    "visible_gpus",
]

# the environment of a group with ``resources.deterministic`` (read by cuBLAS and Inductor when a rank starts)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCHINDUCTOR_DETERMINISTIC": "1"}


#: What ppoflow keeps at a storage root beside its experiments (the demo's directory holds
#: ``config.yaml``, ``models/`` and ``data/``): names no experiment may take (in any case).
ROOT_ENTRIES = ("config.yaml", "data", "models")


class StorageConfig(Section):
    root: str = Field("runs", description="fsspec URL or path: file://, s3://, memory://")
    experiment: str = Field(
        "default",
        description=f"the experiment's name: its directory (or S3 key prefix) under root; {NAME_RULE}, "
        f"and none of {', '.join(ROOT_ENTRIES)}",
        json_schema_extra={"pattern": f"^{NAME_PATTERN}$"},
    )
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    shared_filesystem: bool = Field(
        False,
        description="a local `root` is a filesystem mounted at the same path on every node (NFS, "
        "Lustre): lets a multi-node run (resources.launch: rendezvous) use it instead of S3",
    )

    @field_validator("experiment")
    @classmethod
    def _experiment_name(cls, value: str) -> str:
        """A name, not a path: it cannot leave the root nor take a name the root's own files have."""
        problem = name_problem(value, "experiment name (one directory under storage.root)")
        if problem is not None:
            raise ValueError(problem)
        if value.lower() in ROOT_ENTRIES:
            raise ValueError(
                f"{value!r} is a name ppoflow keeps beside the experiments at a storage root "
                f"({', '.join(ROOT_ENTRIES)}: the demo's config, models and data); name the experiment "
                f"otherwise, e.g. {value.replace('.', '-') + '-run'!r}"
            )
        return value

    @property
    def experiment_url(self) -> str:
        return self.root.rstrip("/") + "/" + self.experiment


class RendezvousConfig(Section):
    """Worker groups whose ranks span nodes (``resources.launch: rendezvous``). Each node runs
    ``ppoflow agent --driver <driver_host>:<control_port>``; the flow's process hosts the control
    endpoint and the c10d rendezvous store. The cluster key comes from the environment
    (PPOFLOW_CLUSTER_KEY_FILE / PPOFLOW_CLUSTER_KEY), never from this config."""

    nnodes: int = Field(2, ge=1, description="nodes every worker group spans (one `ppoflow agent` each)")
    nproc_per_node: int = Field(1, ge=1, description="ranks per node (one per GPU)")
    driver_host: str | None = Field(
        None, description="address the agents and ranks reach the flow's process at; None = its FQDN"
    )
    bind_host: str = Field(
        "0.0.0.0",
        description="interface the control endpoint listens on (every connection must pass the "
        "cluster-key handshake)",
    )
    control_port: int = Field(
        29401, ge=0, le=65535, description="the agents' --driver port; ranks dial it too"
    )
    rdzv_port: int = Field(
        29400,
        ge=0,
        le=65535,
        description="the c10d rendezvous store (torchrun --rdzv-endpoint), on the driver",
    )
    join_timeout_s: float = Field(
        300.0,
        gt=0,
        description="how long a group start waits for every node's agent, then for the rendezvous",
    )


class CheckpointConfig(Section):
    """The actor's and critic's sharded checkpoints: a snapshot every ``snapshot_every`` iterations
    and at the end of each run; every committed iteration in between is rebuilt from the latest snapshot by replaying its
    stored updates (docs/checkpoints.md)."""

    snapshot_every: int = Field(
        10,
        ge=1,
        description="write the model and optimizer state every k-th iteration; the iterations in "
        "between commit without writing it, and are rebuilt when needed (a resume, export-hf, eval, "
        "rollback) by replaying their updates from the stored batches. 1: write every iteration",
    )
    snapshot_at_end: bool = Field(
        True,
        description="the last iteration of every run writes a snapshot too, so a finished run "
        "exports, evaluates and resumes without a replay; false: only every snapshot_every-th",
    )

    async_save: bool = Field(
        True,
        description="stage to host memory and write in the background (commit n waits for it, the "
        "next iteration does not); false: the update tasks write before they finish",
    )
    keep_last: int | None = Field(
        3,
        ge=1,
        description="keep what the last K committed iterations need (their snapshot, or their own "
        "checkpoint); null = keep all",
    )
    keep_every: int = Field(
        0, ge=0, description="also keep every M-th iteration's checkpoints (0 = none beyond keep_last)"
    )
    keep_every_weights_only: bool = Field(
        True,
        description="the every-M-th checkpoints keep only the model weights once they leave the last K "
        "(for export or as a reference policy; the optimizer state, 2/3 of a checkpoint, is deleted)",
    )
    verify: bool = Field(True, description="check every file's size and content hash before loading")
    write_attempts: int = Field(3, ge=1, description="DCP write attempts per checkpoint (storage hiccups)")
    write_threads: int = Field(
        1,
        ge=1,
        description="files each rank writes in parallel (DCP thread_count; try 4 on fast local disks)",
    )
    wait_timeout_s: float = Field(
        3600.0, gt=0, description="how long commit waits for a background write before failing"
    )


#: Where NVIDIA's driver lists the host's GPUs, one directory each.
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus(driver_list: str = NVIDIA_GPUS) -> int:
    """The GPUs a process started here would see, without initialising CUDA (a config is read in
    processes that must not): NVIDIA's driver lists one directory per GPU under ``driver_list``,
    and ``CUDA_VISIBLE_DEVICES`` keeps the entries before its first invalid one (``-1`` hides them
    all), as CUDA does; where the driver's list is missing and torch is already imported,
    ``torch.cuda.device_count()``."""
    try:
        count = len(os.listdir(driver_list))
    except OSError:
        torch = sys.modules.get("torch")
        count = int(torch.cuda.device_count()) if torch is not None else 0
        return count
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return count
    kept = 0
    for entry in shown.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        kept += 1
    return min(count, kept)


class ResourcesConfig(Section):
    launch: Literal["local", "rendezvous"] = Field(
        "local",
        description="local: every group's ranks on the flow's host (torchrun --standalone); "
        "rendezvous: on `rendezvous.nnodes` nodes, each running `ppoflow agent`",
    )
    nprocs: int = Field(
        2,
        ge=1,
        description="ranks per worker group (one per GPU); absent or 'auto': every GPU this host "
        "shows (resources.device cuda), 2 on CPU; rendezvous: nnodes x nproc_per_node",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="absent or 'auto': cuda when this host shows a GPU (NVIDIA's driver, narrowed "
        "by CUDA_VISIBLE_DEVICES), else cpu",
    )
    threads_per_rank: int | None = Field(None, description="CPU threads per rank; None = cores / ranks")
    visible_devices: str | None = Field(
        None,
        description="CUDA_VISIBLE_DEVICES of the groups' ranks (e.g. '0'; asynchronous training puts "
        "the rollout group elsewhere with asynchronous.producer.visible_devices); None: inherited",
    )
    connect_timeout_s: float = Field(
        120.0,
        gt=0,
        description="how long a worker group's start waits for every rank to connect (rendezvous: "
        "at least rendezvous.join_timeout_s); a group whose ranks do not all connect fails the run",
    )
    deterministic: bool = Field(
        False,
        description="deterministic kernels in the actor's and critic's updates (GPU: FlashAttention's "
        "deterministic backward, no autotuning, a fixed cuBLAS workspace): a replay between snapshots "
        "then equals the lost state bit for bit on GPUs too, at a cost (docs/checkpoints.md). CPU "
        "updates are deterministic either way",
    )
    task_retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Prefect retries of each task on a failure a retry may fix (a dead rank, a storage "
        "hiccup, a timeout); errors a retry cannot fix are never retried (docs/failures.md). 0: the "
        "first such failure fails the run, for a run whose faults are expected (a drill) or watched",
    )
    rendezvous: RendezvousConfig = Field(default_factory=RendezvousConfig)

    @model_validator(mode="before")
    @classmethod
    def _world_from_nodes(cls, data: Any) -> Any:
        """``device`` absent or ``auto``: what this host shows (:func:`visible_gpus`). ``nprocs``
        absent or ``auto``: with ``launch: rendezvous`` the world (nnodes x nproc_per_node), else
        one rank per visible GPU on cuda, 2 on CPU."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("device", "auto") == "auto":
            data["device"] = "cuda" if visible_gpus() else "cpu"
        if data.get("nprocs", "auto") != "auto":
            return data
        if data.get("launch") == "rendezvous":
            nodes = data.get("rendezvous")
            nodes = nodes.model_dump() if isinstance(nodes, RendezvousConfig) else dict(nodes or {})
            try:
                data["nprocs"] = int(nodes.get("nnodes", 2)) * int(nodes.get("nproc_per_node", 1))
            except (TypeError, ValueError):
                data.pop("nprocs", None)  # the field validators report the bad number
        elif data["device"] == "cuda":
            data["nprocs"] = max(1, visible_gpus())
        else:
            data["nprocs"] = 2
        return data

    @model_validator(mode="after")
    def _check_world(self) -> ResourcesConfig:
        nodes = self.rendezvous
        if self.launch == "rendezvous" and self.nprocs != nodes.nnodes * nodes.nproc_per_node:
            raise ValueError(
                f"resources.nprocs={self.nprocs} must equal rendezvous.nnodes={nodes.nnodes} x "
                f"rendezvous.nproc_per_node={nodes.nproc_per_node} (or leave nprocs out)"
            )
        return self
