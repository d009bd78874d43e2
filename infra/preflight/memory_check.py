"""The memory plan in the preflight: the device's capacity, the plan's lines in the report, the
refusal of a config that cannot fit (with the numbers and the cheapest fixes, each replanned:
:mod:`ppoflow.infra.preflight.memory_fixes`), and ``auto`` update token budgets raised to the
largest that fits.

    check_memory(cfg, c)                        # lines and problems into the preflight's Checks
    chosen = refine_auto_budgets(cfg, log)      # GPU: auto budgets -> the largest that fits

Capacity: on CUDA, each GPU's memory from ``nvidia-smi`` (the GPUs the ranks will see:
``resources.visible_devices``, else ``CUDA_VISIBLE_DEVICES``), never by initialising CUDA here (the
flow's process would hold a context on GPU 0 for the whole run), or torch's figure where this
process has initialised CUDA already. On CPU ranks the host's memory is the device:
:mod:`ppoflow.infra.preflight.resources` checks it, with this plan's figures added to its measured
rank runtime.

A config is refused when the plan's peak exceeds the device; it is noted as tight above
:data:`TIGHT` of it. An ``auto`` budget leaves :data:`SPARE` of the device for the plan's error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.preflight.memory_fixes import (
    BUDGET_STEP,
    budget_sections,
    largest_budget,
    memory_fixes,
    model_shapes,
    plan_of,
)
from ppoflow.infra.preflight.memory_plan import GIB, STAGES, MemoryPlan
from ppoflow.infra.preflight.report import Checks

__all__ = ["check_memory", "plan_lines", "gpu_capacity", "refine_auto_budgets", "TIGHT", "SPARE"]

TIGHT = 0.95
SPARE = 0.05


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _visible(cfg: ExperimentConfig) -> list[str] | None:
    shown = cfg.resources.visible_devices
    shown = shown if shown is not None else os.environ.get("CUDA_VISIBLE_DEVICES")
    if shown is None:
        return None
    out = []
    for entry in shown.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break  # CUDA keeps the entries before the first invalid one
        out.append(entry)
    return out


def gpu_capacity(cfg: ExperimentConfig, query: Callable[[], str] | None = None) -> int | None:
    """The smallest memory of the GPUs the ranks will use, in bytes (module docstring); None where
    it cannot be read. ``query``: returns ``nvidia-smi``'s CSV (index, uuid, MiB), for tests."""
    torch = sys.modules.get("torch")
    if query is None and torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.mem_get_info()[1])
    if query is None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None

        def query() -> str:
            args = [exe, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"]
            return subprocess.run(args, capture_output=True, text=True, timeout=20, check=True).stdout

    try:
        rows = [[p.strip() for p in line.split(",")] for line in query().splitlines() if line.strip()]
        gpus = {(r[0], r[1]): int(float(r[2])) * 2**20 for r in rows}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    visible = _visible(cfg)
    if visible is not None:
        chosen = [m for e in visible for (i, u), m in gpus.items() if e in (i, u) or u.startswith(e)]
    else:
        chosen = list(gpus.values())
    chosen = chosen[: cfg.resources.nprocs]
    return min(chosen) if chosen else None


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The plan in a few lines: each group's resident state and each stage's device total, then
    per group its peak in each stage and its largest parts."""
    where = "per GPU" if plan.device == "cuda" else f"host, {plan.ranks_per_device} rank(s) a group"
    groups = ", ".join(f"{g.role} {_gib(g.resident)}" for g in plan.groups)
    totals = plan.totals()
    stages = ", ".join(f"{s} {_gib(totals[s])}" for s in STAGES)
    cap = f" of {_gib(plan.capacity)} GiB" if plan.capacity else ""
    out = [f"memory plan ({where}, GiB): resident per rank {groups}; stage totals {stages}{cap}"]
    for g in plan.groups:
        big = sorted(((v, k) for k, v in g.parts.items() if v >= 0.05 * GIB), reverse=True)[:5]
        if big:
            peaks = ", ".join(f"{s} {_gib(g.stages[s])}" for s in STAGES)
            parts = ", ".join(f"{k} {_gib(v)}" for v, k in big)
            out.append(f"memory plan: {g.role} rank: peaks {peaks}; largest parts {parts}")
    return out


def check_memory(
    cfg: ExperimentConfig, c: Checks, capacity: int | None = None, host: int | None = None
) -> None:
    """The plan of a CUDA run against its GPUs (module docstring): its lines, and a problem when it
    cannot fit (or vLLM could not start beside the models, or what it offloads does not fit the
    ``host`` bytes free here); ``capacity``: bytes of one GPU instead of what is read here."""
    capacity = capacity if capacity is not None else gpu_capacity(cfg)
    plan = plan_of(cfg, capacity)
    if plan is None or capacity is None:
        why = (
            "no GPU memory figure here" if plan is not None else "a model's config.json is not readable here"
        )
        c.report.notes.append(f"memory plan skipped: {why}")
        return
    for line in plan_lines(plan):
        c.ok(line)
    stage, peak = plan.peak()
    if peak > capacity:
        fixes, found = memory_fixes(cfg, capacity, host=host)
        tail = (
            ""
            if found
            else "; none of these fits: use more GPUs (resources.nprocs: FSDP shards the states over them)"
        )
        groups = " + ".join(f"{g.role} {_gib(g.stages[stage])}" for g in plan.groups)
        c.problem(
            f"memory (resources.device=cuda, {cfg.resources.nprocs} GPU(s) of {_gib(capacity)} GiB)",
            f"the memory plan needs {_gib(peak)} GiB per GPU at its peak ({stage}: {groups} + "
            f"{len(plan.groups)} process(es) x {_gib(plan.process_bytes['actor'])} GiB of CUDA context), and a GPU holds "
            f"{_gib(capacity)} GiB: a rank would run out of device memory",
            "cheapest first, each on top of the ones before (the plan's peak after it): "
            + "; ".join(f"({i}) {line}" for i, line in enumerate(fixes, 1))
            + tail,
        )
    elif peak > TIGHT * capacity:
        c.report.notes.append(
            f"memory plan: the {stage} peak, {_gib(peak)} GiB, is within {100 * (1 - TIGHT):.0f}% of the "
            f"GPU's {_gib(capacity)} GiB (the plan's error is stated in docs/gpus.md)"
        )
    ranks = cfg.resources.nprocs  # every rank on this host (a multi-node run is not checked here)
    if host is not None and ranks * plan.host() > host:
        c.problem(
            "memory (host)",
            f"the memory plan puts {_gib(plan.host())} GiB a GPU in host memory (offloaded states, a "
            f"sleeping engine's weights), {_gib(ranks * plan.host())} GiB for {ranks} GPU(s), and this "
            f"process may take {_gib(host)} GiB",
            "offload less (fsdp.param_offload, fsdp.optimizer_offload; rollout.sleep_level 2 keeps no weights), or "
            "run where the host has more memory",
        )
    _check_engine_start(cfg, plan, capacity, c)


def _check_engine_start(cfg: ExperimentConfig, plan: MemoryPlan, capacity: int, c: Checks) -> None:
    """vLLM starts only where ``gpu_memory_utilization`` of the GPU is free: beside every group's
    weights (no optimizer state yet) and the processes' fixed cost."""
    actor = plan.group("actor")
    if actor is None or "engine weights" not in actor.parts:
        return
    weights = sum(
        v
        for g in plan.groups
        for k, v in g.parts.items()
        if k.endswith("weights") and not k.startswith(("host:", "engine"))
    )
    taken = weights + sum(plan.process_bytes[g.role] for g in plan.groups)
    util = cfg.rollout.gpu_memory_utilization
    if capacity - taken < util * capacity:
        most = (capacity - taken) / capacity
        c.problem(
            f"rollout.gpu_memory_utilization={util:g}",
            f"vLLM starts only when {util:g} x {_gib(capacity)} GiB is free, and the models' weights and "
            f"the processes take {_gib(taken)} GiB of the GPU first",
            f"lower it to at most {max(0.0, most - 0.01):.2f} (with kv_cache_gib auto the KV cache is sized "
            "to the batch, capped at 0.75 of this share), or keep weights off the GPU (the memory fixes)"
            if most > 0.05
            else "see the memory plan's fixes",
        )


def refine_auto_budgets(
    cfg: ExperimentConfig, log: Callable[[str], None], capacity: int | None = None
) -> int | None:
    """On CUDA (local ranks): raise or lower the ``auto`` update token budgets (``actor``/``critic``
    ``.ppo_max_token_len_per_gpu`` given as ``auto``) to the largest the plan fits with
    :data:`SPARE` of the GPU left, in place, before any group starts; logs and returns the choice
    (None: nothing changed: CPU, no auto budget, no plan here, or not even one row fits, which
    the preflight then refuses)."""
    if cfg.resources.device != "cuda" or cfg.resources.launch != "local":
        return None
    sections = budget_sections(cfg, True)
    if not sections:
        return None
    capacity = capacity if capacity is not None else gpu_capacity(cfg)
    if capacity is None or model_shapes(cfg) is None:
        return None
    best = largest_budget(cfg, capacity, SPARE, sections)
    if best is None:
        return None
    was = {s: getattr(cfg, s).ppo_max_token_len_per_gpu for s in sections}
    for s in sections:
        getattr(cfg, s).ppo_max_token_len_per_gpu = best
    plan = plan_of(cfg, capacity)
    assert plan is not None
    stage, peak = plan.peak()
    log(
        f"memory plan: {'/'.join(sections)}.ppo_max_token_len_per_gpu auto -> {best} tokens (was "
        f"{', '.join(str(v) for v in was.values())}): the largest multiple of {BUDGET_STEP} with which the "
        f"{stage} peak, {_gib(peak)} GiB, leaves {100 * SPARE:.0f}% of the GPU's {_gib(capacity)} GiB"
    )
    return best
