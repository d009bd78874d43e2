"""Preflight of ``resources.*``: whether this machine can hold the run's ranks, before any starts.

A run keeps its worker groups for its whole length: the actor's, the critic's (``critic.enable``)
and the reward model's (``reward.reward_model.enable``), each of ``resources.nprocs`` ranks, and
it starts them together. What is checked (``resources.launch: local``; the ranks of a multi-node
run live on the nodes, not here):

- ``device: cuda``: one GPU per rank; more ranks than the GPUs this process sees
  (``torch.cuda.device_count()``, which honours ``CUDA_VISIBLE_DEVICES``) is refused. Then the
  memory plan against each GPU's memory (:mod:`ppoflow.infra.preflight.memory_check`).
- ``device: cpu``, memory: every rank holds at least the figures measured below (the demo's tiny
  models: a rank is mostly its runtime, torch, transformers and vLLM, whatever its model), plus
  what the memory plan (:mod:`ppoflow.infra.preflight.memory_plan`) counts for its models where their
  ``config.json`` can be read: weights, gradients, optimizer state, activations, the engine's KV
  cache, at the stage where the run's ranks together hold the most; against the memory this
  process may still take (``MemAvailable``, and a cgroup's limit less its usage). More is refused:
  the kernel would kill ranks mid-start.
- ``device: cpu``, start: a rank spends at least :data:`RANK_START_CPU_S` CPU-seconds before it
  connects (Python, torch and ppoflow's imports, measured); the run's ranks start together, so
  they need ``ranks x that / cores`` seconds at least. More than ``resources.connect_timeout_s``
  is refused: no rank would connect in time.
- ``device: cpu``, cores: a group's ranks x threads per rank (``resources.threads_per_rank``, else
  what each rank takes: the machine's cores / ranks, at least 1) against the cores this process may
  use (its CPU affinity and a cgroup's CPU quota). More is a warning, once per run: the ranks share
  cores and every step is slower, but it runs.

Each refusal names the numbers and the fix (fewer ranks, a smaller reward or critic setup, more
memory or cores).
"""

from __future__ import annotations

import math
import os

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.preflight.memory_check import check_memory, plan_lines
from ppoflow.infra.preflight.memory_fixes import memory_fixes, plan_of
from ppoflow.infra.preflight.report import Checks

__all__ = [
    "check_resources",
    "usable_cores",
    "available_memory_mib",
    "rank_memory_mib",
    "ACTOR_RANK_MIB",
    "CRITIC_RANK_MIB",
    "RANK_START_CPU_S",
]

#: Private memory (USS) an actor rank holds at least: the FSDP actor, its reference and the vLLM CPU
#: engine. Measured on the demo (``ppoflow demo``: 2 CPU ranks, a 2-layer Qwen2, KV cache 0.05 GiB;
#: 2 cores, torch 2.13 CPU, vLLM 0.32 CPU): peak per rank 606-613 MiB private, 817-823 MiB RSS.
ACTOR_RANK_MIB = 600
#: The same for a critic (or reward model) rank, and for an actor rank with ``rollout.engine: hf``
#: (no vLLM engine): measured on the demo's critic ranks, 357-369 MiB private, 515-527 MiB RSS.
CRITIC_RANK_MIB = 350
#: CPU-seconds a CPU rank spends before it connects to the driver (importing Python, torch and the
#: rank's modules, then gloo's start): measured 2.5-3.1 s user + system on the same machine.
RANK_START_CPU_S = 2.5


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us``) where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cpu_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup may use (None: no quota)."""
    text = _read("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.partition(" ")
        if quota != "max" and period:
            return int(quota) / int(period)
        return None
    quota_us, period_us = (
        _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    )
    if quota_us and period_us and int(quota_us) > 0:
        return int(quota_us) / int(period_us)
    return None


def available_memory_mib() -> int | None:
    """MiB this process may still take: ``MemAvailable`` of ``/proc/meminfo``, capped by a
    cgroup's memory limit less its usage (v2, v1); None where neither can be read."""
    found: list[int] = []
    meminfo = _read("/proc/meminfo") or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) // 1024)
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read(limit_path), _read(usage_path)
        if limit and usage and limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            found.append(max(0, int(limit) - int(usage)) >> 20)
    return min(found) if found else None


def _groups(cfg: ExperimentConfig) -> list[str]:
    """The run's worker groups (their roles)."""
    return (
        ["actor"]
        + (["critic"] if cfg.critic.enable else [])
        + (["reward_model"] if cfg.reward.reward_model.enable else [])
    )


def rank_memory_mib(cfg: ExperimentConfig, role: str) -> int:
    """The measured private memory of one rank of ``role`` (the module's figures)."""
    return ACTOR_RANK_MIB if role == "actor" and cfg.rollout.engine == "vllm" else CRITIC_RANK_MIB


def check_resources(
    cfg: ExperimentConfig,
    c: Checks,
    *,
    cores: int | None = None,
    memory_mib: int | None = None,
    gpus: int | None = None,
    gpu_bytes: int | None = None,
) -> None:
    """Each problem of ``resources.*`` on this machine into ``c`` (the module docstring);
    ``cores``, ``memory_mib``, ``gpus`` and ``gpu_bytes`` (one GPU's memory) replace what is read
    from the machine."""
    res = cfg.resources
    if res.launch != "local":
        c.ok(f"resources: {res.nprocs} ranks per group on {res.rendezvous.nnodes} nodes (their machines')")
        return
    if res.device == "cuda":
        _check_gpus(cfg, c, gpus)
        free = available_memory_mib() if memory_mib is None else memory_mib
        check_memory(cfg, c, gpu_bytes, None if free is None else free << 20)
        return
    groups = _groups(cfg)
    cores = cores or usable_cores()
    before = len(c.problems)
    _check_memory(cfg, c, groups, available_memory_mib() if memory_mib is None else memory_mib)
    ranks = res.nprocs * len(groups)
    start_s = ranks * RANK_START_CPU_S / cores
    if start_s > res.connect_timeout_s:
        fit = max(1, int(res.connect_timeout_s * cores / RANK_START_CPU_S) // len(groups))
        c.problem(
            f"resources.nprocs={res.nprocs}",
            f"the run starts its {len(groups)} worker group(s) together: {ranks} ranks, each spending at "
            f"least {RANK_START_CPU_S:g} CPU-seconds before it connects (Python and torch imports), on "
            f"the {cores} core(s) this process may use take at least {start_s:.0f} s, more than "
            f"resources.connect_timeout_s={res.connect_timeout_s:g}: the ranks cannot all connect in time",
            f"lower resources.nprocs to at most {fit} (one rank per core is the fastest), or run where "
            "there are more cores",
        )
    threads = res.threads_per_rank or max(1, (os.cpu_count() or 1) // res.nprocs)
    if res.nprocs * threads > cores:
        c.report.notes.append(
            f"resources: {res.nprocs} ranks x {threads} thread(s) per group = {res.nprocs * threads} threads "
            f"on the {cores} core(s) this process may use: the ranks share cores and every step is "
            f"slower; resources.nprocs <= {cores} (with resources.threads_per_rank x nprocs <= {cores}) "
            "gives each rank a core of its own"
        )
    if len(c.problems) == before:
        c.ok(f"resources: {ranks} CPU rank(s) in {len(groups)} group(s) on {cores} core(s)")


def _check_memory(cfg: ExperimentConfig, c: Checks, groups: list[str], free: int | None) -> None:
    """The run's ranks' memory against ``free`` MiB (None: not known here): the measured runtime of
    each rank, plus the memory plan's figures where the models' shapes can be read."""
    n = cfg.resources.nprocs
    runtime = {role: rank_memory_mib(cfg, role) for role in {*groups, "actor", "critic", "reward_model"}}
    plan = plan_of(cfg, None, {role: mib << 20 for role, mib in runtime.items()})
    per_rank = {role: runtime[role] for role in groups}
    if plan is not None:
        for line in plan_lines(plan):
            c.ok(line)
        stage = plan.peak()[0]
        per_rank.update({g.role: runtime[g.role] + (g.stages[stage] >> 20) for g in plan.groups})
    per_set = sum(per_rank.values())
    need = n * per_set if plan is None else plan.peak()[1] >> 20
    per_set = max(1, need // n)
    if free is None or need <= free:
        return
    parts = " + ".join(f"{role} {mib}" for role, mib in per_rank.items())
    fit = free // per_set
    fix = (
        f"lower resources.nprocs to at most {fit}"
        if fit >= 1
        else "free memory, or run where there is more (not even one rank per group fits)"
    )
    if len(groups) > 1:
        fix += " (or run fewer groups: critic.enable=false with a critic-free estimator, no reward model)"
    what = "measured on the demo's tiny models"
    if plan is not None:
        what = (
            f"the rank runtime measured on the demo's tiny models + the memory plan's {plan.peak()[0]} stage"
        )
        fixes, found = memory_fixes(cfg, free << 20, {role: mib << 20 for role, mib in runtime.items()})
        if found:  # else the models are not what fills the memory: the ranks are
            fix += "; or, cheapest first, each on top of the ones before: " + "; ".join(fixes)
    c.problem(
        f"resources.nprocs={n}",
        f"{len(groups)} worker group(s) x {n} ranks need at least {need / 1024:.1f} GiB ({n} x ({parts}) MiB "
        f"per rank, {what}), and this process may take {free / 1024:.1f} GiB "
        "(available memory, cgroup limit): the ranks would be killed for lack of memory",
        fix,
    )


def _check_gpus(cfg: ExperimentConfig, c: Checks, gpus: int | None) -> None:
    """One GPU per rank of a CUDA group on this machine."""
    n = cfg.resources.nprocs
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    if n <= gpus:
        c.ok(f"resources: {n} CUDA rank(s) per group on {gpus} visible GPU(s)")
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    c.problem(
        f"resources.nprocs={n}",
        f"a CUDA rank needs a GPU of its own, and this process sees {gpus} GPU(s){shown}",
        f"lower resources.nprocs to {gpus}"
        if gpus
        else "run where a GPU is visible, or set resources.device=cpu",
    )
