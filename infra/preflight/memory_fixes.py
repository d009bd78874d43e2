"""Replanning: the memory plan of a config as its models' ``config.json`` give it, the largest update
token budget that fits a device, and the cheapest fixes of a config that does not fit, each applied
on a copy of the config and planned again (:mod:`ppoflow.infra.preflight.memory_plan`).

    lines, fits = memory_fixes(cfg, capacity)       # "(what to set): <peak> GiB" each, in order
    largest_budget(cfg, capacity, 0.05, ["actor", "critic"])

The fixes, cheapest first, each on top of the ones before, stopping at the first that fits:
a distillation teacher's weights in bfloat16 on GPUs (``teacher.model.dtype``: it computes in
bfloat16 there already, and is never trained); recompute (``model.enable_gradient_checkpointing``);
a smaller update token budget (the largest multiple of :data:`BUDGET_STEP` that fits, searched);
``fsdp.optimizer_offload`` (it lowers the stages between updates only: the moments come back for
the update); ``fsdp.param_offload`` (the reference's and the teacher's too); LoRA adapters of rank
:data:`LORA_RANK` (on GPUs over a bfloat16 base: nothing of it is trained; without compile, which
LoRA cannot follow); a critic-free estimator (``grpo``). A fix that lowers nothing is said and
left out.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.config.names import given_auto
from ppoflow.infra.config.teacher import teacher_in_use
from ppoflow.infra.preflight.memory_plan import (
    GIB,
    MemoryPlan,
    memory_plan,
    micro_batch_tokens,
    needs_reference,
)
from ppoflow.infra.preflight.model_shape import ModelShape, read_shape

__all__ = [
    "model_shapes",
    "plan_of",
    "largest_budget",
    "budget_sections",
    "memory_fixes",
    "LORA_RANK",
    "BUDGET_STEP",
]

#: The adapters' rank the LoRA fix proposes.
LORA_RANK = 32
BUDGET_STEP = 1024


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def model_shapes(cfg: ExperimentConfig) -> dict[str, ModelShape] | None:
    """The shapes the plan needs (policy; critic, reward model and teacher where they run); None
    when one ``config.json`` cannot be read here."""
    wanted = {"policy": cfg.model}
    if teacher_in_use(cfg) and cfg.teacher is not None:
        wanted["teacher"] = cfg.teacher.model
    if cfg.critic.enable:
        wanted["critic"] = cfg.critic_model
    rm = cfg.reward.reward_model
    if rm.enable and rm.model is not None:
        wanted["reward_model"] = rm.model
    shapes = {role: read_shape(model) for role, model in wanted.items()}
    if any(s is None for s in shapes.values()):
        return None
    return {role: s for role, s in shapes.items() if s is not None}


def plan_of(
    cfg: ExperimentConfig, capacity: int | None, cpu_process_bytes: dict[str, int] | None = None
) -> MemoryPlan | None:
    """The plan of ``cfg`` where its models' shapes can be read here, else None."""
    shapes = model_shapes(cfg)
    return None if shapes is None else memory_plan(cfg, shapes, capacity, cpu_process_bytes)


def _fits(
    cfg: ExperimentConfig, capacity: int, spare: float = 0.0, cpu: dict[str, int] | None = None
) -> int | None:
    """The plan's peak when it fits ``capacity`` less ``spare`` of it, else None."""
    plan = plan_of(cfg, capacity, cpu)
    if plan is None:
        return None
    peak = plan.peak()[1]
    return peak if peak <= capacity * (1 - spare) else None


def budget_sections(cfg: ExperimentConfig, only_auto: bool) -> list[str]:
    """The sections whose packed update budget may change (``actor``, ``critic``): all, or those
    given ``auto``."""
    packed: list[tuple[str, BaseModel, bool]] = [("actor", cfg.actor, cfg.actor.use_dynamic_bsz)]
    if cfg.critic.enable:
        packed.append(("critic", cfg.critic, cfg.critic.packed))
    return [
        name
        for name, section, on in packed
        if on and (not only_auto or "ppo_max_token_len_per_gpu" in given_auto(section))
    ]


def largest_budget(
    cfg: ExperimentConfig, capacity: int, spare: float, sections: list[str], cpu: dict[str, int] | None = None
) -> int | None:
    """The largest update token budget (per GPU, a multiple of :data:`BUDGET_STEP`, at least the
    longest row's share of a rank) with which the plan fits ``capacity`` less ``spare``, given to
    the named sections (``actor``, ``critic``) at once; never above a rank's whole batch (a larger
    budget changes no micro-batch: an update's stops at the mini-batch, a forward's, twice the
    budget by default, at the batch).
    None when not even the longest row fits."""
    longest = cfg.rollout.prompt_length + cfg.rollout.response_length
    trial = cfg.model_copy(deep=True)
    parts = [getattr(trial, s) for s in sections]
    floor = max(-(-longest // p.sequence_parallel_size) for p in parts)
    for p in parts:  # unbounded: the plan then counts a rank's whole batch in every pass
        p.ppo_max_token_len_per_gpu = 2**40
    passes = [micro_batch_tokens(trial, s) for s in sections]
    whole = max(max(t["update"], -(-t["forward"] // 2), -(-t["ref"] // 2)) for t in passes)
    top = max(floor, BUDGET_STEP * -(-whole // BUDGET_STEP))

    def fits(budget: int) -> bool:
        for p in parts:
            p.ppo_max_token_len_per_gpu = budget
        return _fits(trial, capacity, spare, cpu) is not None

    if not fits(floor):
        return None
    lo, hi = 1, top // BUDGET_STEP  # the largest k with max(floor, k * step) fitting
    best = floor
    while lo <= hi:
        k = (lo + hi) // 2
        if fits(max(floor, k * BUDGET_STEP)):
            best, lo = max(floor, k * BUDGET_STEP), k + 1
        else:
            hi = k - 1
    return best


def _lora(cfg: ExperimentConfig) -> None:
    for section in (cfg.actor, cfg.critic):
        section.lora.rank = LORA_RANK
        section.lora.alpha = 2.0 * LORA_RANK
    for model in (cfg.model, cfg.critic.model):
        if model is not None:
            model.use_torch_compile = False
            if model.dtype == "float32" and cfg.resources.device == "cuda":
                model.dtype = "bfloat16"


def _teacher_steps(cfg: ExperimentConfig) -> list[tuple[str, Callable[[ExperimentConfig], None]]]:
    """The teacher's own fix, the cheapest of all: on GPUs, where it computes in bfloat16 over
    float32 weights, its weights in bfloat16 (it is never trained)."""
    teacher = cfg.teacher if teacher_in_use(cfg) else None
    if (
        teacher is None
        or cfg.resources.device != "cuda"
        or teacher.model.dtype != "float32"
        or teacher.fsdp.param_dtype != "bfloat16"
    ):
        return []

    def teacher_bf16(c: ExperimentConfig) -> None:
        assert c.teacher is not None
        c.teacher.model.dtype = "bfloat16"

    what = "teacher.model.dtype=bfloat16 (the frozen teacher computes in bfloat16 already: half its weights)"
    return [(what, teacher_bf16)]


def _steps(cfg: ExperimentConfig) -> list[tuple[str, Callable[[ExperimentConfig], None]]]:
    """The fixes that apply to ``cfg``, cheapest first: (what to set, how) (the budget's own
    step is in :func:`memory_fixes`: it is searched, not set)."""
    critic = cfg.critic.enable
    pair = "actor and critic" if critic else "actor"
    models = [m for m in (cfg.model, cfg.critic.model if critic else None) if m is not None]
    steps: list[tuple[str, Callable[[ExperimentConfig], None]]] = []
    teacher = cfg.teacher if teacher_in_use(cfg) else None
    steps += _teacher_steps(cfg)
    if not all(m.enable_gradient_checkpointing for m in models):

        def recompute(c: ExperimentConfig) -> None:
            for m in (c.model, c.critic.model):
                if m is not None:
                    m.enable_gradient_checkpointing = True

        steps.append(
            (
                "model.enable_gradient_checkpointing=true (recompute: about a third more update time)",
                recompute,
            )
        )
    steps.append(("budget", lambda c: None))
    fsdp = [cfg.actor.fsdp] + ([cfg.critic.fsdp] if critic else [])
    if not all(f.optimizer_offload or f.param_offload for f in fsdp):

        def optimizer(c: ExperimentConfig) -> None:
            for f in (c.actor.fsdp, c.critic.fsdp):
                f.optimizer_offload = True

        what = f"fsdp.optimizer_offload=true ({pair}: the moments wait on the host between updates, not during them)"
        steps.append((what, optimizer))
    if not all(f.param_offload for f in fsdp):

        def params(c: ExperimentConfig) -> None:
            for f in (c.actor.fsdp, c.critic.fsdp, c.ref.fsdp):
                f.param_offload = True
            if teacher is not None and c.teacher is not None:
                c.teacher.fsdp.param_offload = True

        ref = " and ref" if needs_reference(cfg) and not cfg.actor.lora.enabled else ""
        ref += " and teacher" if teacher is not None else ""
        what = f"fsdp.param_offload=true ({pair}{ref}: weights, gradients and moments on the host)"
        steps.append((what, params))
    if not cfg.actor.lora.enabled:
        base = (
            "model.dtype=bfloat16: nothing of the base is trained; " if cfg.resources.device == "cuda" else ""
        )
        what = f"actor.lora.rank={LORA_RANK} (and critic.lora; {base}no compile)"
        steps.append((what, _lora))
    if critic:

        def critic_free(c: ExperimentConfig) -> None:
            c.critic.enable = False
            c.algorithm.adv_estimator = "grpo"

        steps.append(("algorithm.adv_estimator=grpo (no critic; rollout.n >= 2)", critic_free))
    return steps


def _peak(cfg: ExperimentConfig, capacity: int, cpu: dict[str, int] | None) -> int:
    plan = plan_of(cfg, capacity, cpu)
    return plan.peak()[1] if plan is not None else 0


def _host(cfg: ExperimentConfig, capacity: int, cpu: dict[str, int] | None) -> int:
    plan = plan_of(cfg, capacity, cpu)
    return plan.host() if plan is not None and cpu is None else 0


def _budget_step(trial: ExperimentConfig, capacity: int, cpu: dict[str, int] | None) -> str | None:
    """The smaller update budget that fits, set on ``trial``; or what one row needs, unset."""
    sections = budget_sections(trial, False)
    if not sections:
        return None
    names = "/".join(sections) + ".ppo_max_token_len_per_gpu"
    current = max(getattr(trial, s).update_tokens for s in sections)
    best = largest_budget(trial, capacity, 0.0, sections, cpu)
    if best is None:
        one = trial.model_copy(deep=True)
        row = trial.rollout.prompt_length + trial.rollout.response_length
        for s in sections:
            getattr(one, s).ppo_max_token_len_per_gpu = -(-row // getattr(one, s).sequence_parallel_size)
        return f"a smaller {names} is not enough: one row a micro-batch still needs {_gib(_peak(one, capacity, cpu))} GiB"
    if best >= current:
        return None
    for s in sections:
        getattr(trial, s).ppo_max_token_len_per_gpu = best
    return f"{names}={best} (the largest that fits)"


def memory_fixes(
    cfg: ExperimentConfig, capacity: int, cpu: dict[str, int] | None = None, host: int | None = None
) -> tuple[list[str], bool]:
    """The cheapest fixes in order (module docstring), each on top of the ones before, with the
    plan's peak after it; stops at the first that fits, saying then the largest update budget
    that fits with it. ``host``: bytes of host memory free for what a fix moves there (a fix
    that needs more is left out). Returns (the lines, whether one fits)."""
    trial, lines = cfg.model_copy(deep=True), list[str]()
    for what, apply in _steps(cfg):
        if what == "budget":
            line = _budget_step(trial, capacity, cpu)
            if line is not None and not line.startswith("a smaller"):
                line += f": {_gib(_peak(trial, capacity, cpu))} GiB - fits"
                return [*lines, line], True
            lines += [line] if line is not None else []
            continue
        before = trial.model_copy(deep=True)
        apply(trial)
        total, held = _peak(trial, capacity, cpu), _host(trial, capacity, cpu)
        if host is not None and held > host:
            lines.append(
                f"{what}: puts {_gib(held)} GiB in host memory, where {_gib(host)} GiB is free: left out"
            )
            trial = before
            continue
        if total >= _peak(before, capacity, cpu):
            lines.append(f"{what}: no lower, left out")
            trial = before
            continue
        if total > capacity:
            lines.append(f"{what}: {_gib(total)} GiB")
            continue
        sections = budget_sections(trial, False)
        best = largest_budget(trial, capacity, 0.0, sections, cpu) if sections else None
        room = f"; with it, {'/'.join(sections)}.ppo_max_token_len_per_gpu up to {best} fits" if best else ""
        lines.append(f"{what}: {_gib(total)} GiB - fits{room}")
        return lines, True
    return lines, False
