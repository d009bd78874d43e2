"""The memory plan: what each worker group holds on one device (GPU; on CPU ranks, the host's
memory) per rank and per stage of an iteration, from the config and the models' ``config.json``
(:mod:`ppoflow.infra.preflight.model_shape`): arithmetic only, before any rank starts.

    plan = memory_plan(cfg, {"policy": shape, "critic": shape}, capacity=80 * GIB)
    plan.totals()          # {"generate": bytes, "log_probs": bytes, "update": bytes} per device
    plan.peak()            # ("update", bytes): the stage that decides whether the run fits

Per rank of a group (FSDP shards over ``fsdp.fsdp_size`` ranks, all of them when -1):

- parameters in the model's dtype (``model.dtype``: float32 master weights by default); gradients
  and AdamW's two moments in that dtype for what is trained (LoRA: the adapters, float32, and a
  critic's value head; the base stays frozen in its dtype); ``fsdp.param_offload`` keeps all
  three on the host, ``fsdp.optimizer_offload`` the moments between updates (they come back for
  the update: ``ppoflow.workers.optim.optimizer_state_on``);
- the reference policy only when a KL term reads it (:func:`needs_reference`; with LoRA it is the
  actor's base with the adapters off: no copy);
- a distillation teacher where something reads it (``teacher_in_use``): on the actor's ranks, its
  weights in ``teacher.model.dtype`` sharded over ``teacher.fsdp`` (on the host with
  ``param_offload``), and in the log-prob stage its own forward (its unsharded copies, LM-head
  chunk and activations of one teacher micro-batch) instead of the actor's when that is larger;
- while a model computes: its unsharded compute-dtype copies (the root's embeddings and head, two
  decoder layers), the LM head's chunk (``actor.logprob_chunk_size`` x vocabulary x 4 bytes) and
  the activations of one micro-batch: its tokens (a packed budget, or padded rows x the longest
  row; at most a rank's mini-batch) x the bytes a token keeps
  (:func:`~ppoflow.infra.preflight.model_shape.activation_bytes_per_token`);
- the rollout engine: its weights (engine dtype, 1 MiB a tensor of the pool's granularity) and KV
  cache (``rollout.kv_cache_gib``: ``auto`` sized to the batch as the engine does, a number, or
  null: the whole ``gpu_memory_utilization`` share) and its working memory while awake; asleep
  (``rollout.sleep_level``, GPU only) level 2 keeps nothing, 1 its weights on the host, 0 all.

Stages: ``generate`` (the engine awake beside every group's resident state), ``log_probs`` (old
log-probs, reference, values and reward-model scores: forwards), ``update`` (the actor's and the
critic's updates, at the same time on the same devices: their peaks add). Each stage's device
total adds every group's figure and a fixed cost per process (CUDA context and libraries; on CPU
ranks the caller gives the runtime measured in :mod:`ppoflow.infra.preflight.resources`).

The activation and fixed-cost coefficients are measured: docs/gpus.md ("Memory") has the table of
the plan against every measured peak and its error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ppoflow.infra.config import ExperimentConfig, FSDPConfig, LoRAConfig, ModelConfig
from ppoflow.infra.config.teacher import teacher_in_use
from ppoflow.infra.models.rollout_engines import engine_spec
from ppoflow.infra.preflight.memory_engine import (
    GIB,
    auto_kv_cache_bytes,
    engine_memory,
    engine_sleep_level_of,
)
from ppoflow.infra.preflight.model_shape import (
    DTYPE_BYTES,
    ModelShape,
    activation_bytes_per_token,
    activation_path,
    forward_bytes_per_token,
)

__all__ = [
    "MemoryPlan",
    "GroupPlan",
    "memory_plan",
    "needs_reference",
    "micro_batch_tokens",
    "auto_kv_cache_bytes",
    "STAGES",
    "GIB",
]

STAGES = ("generate", "log_probs", "update")

#: The device memory a CUDA process holds outside torch's allocator peaks (context, cuBLAS and
#: NCCL workspaces, compile and CUDA-graph pools): the device peak less the groups' peaks.
CUDA_PROCESS_BYTES = int(2.53 * GIB)


def needs_reference(cfg: Any) -> bool:
    """True when a KL term (in the reward or as a loss) needs the reference policy's log-probs
    (the rule of ``ppoflow.tasks.graph.needs_reference``, which the flow uses; a test keeps them equal)."""
    return bool(cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss)


@dataclass
class GroupPlan:
    """One worker group's figures for one of its ranks, in bytes: ``parts`` by name (what is held
    and when), ``stages`` its peak in each stage, ``host`` what it keeps in host memory instead."""

    role: str
    parts: dict[str, int] = field(default_factory=dict)
    stages: dict[str, int] = field(default_factory=dict)
    host: int = 0
    resident: int = 0  # what stays on the device between stages (a sleeping engine's part included)


@dataclass
class MemoryPlan:
    """The plan of one run (module docstring): its groups, and how many of each group's ranks
    share one device (1 on GPUs; every rank of a group on CPU, where the host is the device)."""

    device: str
    groups: list[GroupPlan]
    ranks_per_device: int
    process_bytes: dict[str, int]
    capacity: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        """Each stage's device total: every group's figure and its processes' fixed cost (on CPU
        ranks, what is offloaded too: the host is the device)."""
        fixed = sum(self.process_bytes[g.role] + (g.host if self.device == "cpu" else 0) for g in self.groups)
        return {
            stage: self.ranks_per_device * (sum(g.stages[stage] for g in self.groups) + fixed)
            for stage in STAGES
        }

    def peak(self) -> tuple[str, int]:
        """The stage with the largest device total, and that total."""
        totals = self.totals()
        stage = max(totals, key=lambda s: totals[s])
        return stage, totals[stage]

    def host(self) -> int:
        """Host memory the device's ranks keep beside it (offloaded states, sleeping weights; on
        CPU ranks already in :meth:`totals`)."""
        return self.ranks_per_device * sum(g.host for g in self.groups)

    def group(self, role: str) -> GroupPlan | None:
        return next((g for g in self.groups if g.role == role), None)


def _shard(cfg: ExperimentConfig, fsdp: FSDPConfig) -> int:
    return cfg.resources.nprocs if fsdp.fsdp_size == -1 else fsdp.fsdp_size


def _trained_state(
    cfg: ExperimentConfig,
    shape: ModelShape,
    model: ModelConfig,
    fsdp: FSDPConfig,
    lora: LoRAConfig,
    head: Any,
) -> tuple[dict[str, int], dict[str, int]]:
    """A trained model's parameters, gradients and AdamW moments on one rank: (on the device
    between stages, what only the update adds); host parts are returned under ``host:`` names."""
    shard, master = _shard(cfg, fsdp), DTYPE_BYTES[model.dtype]
    total = shape.params(head)
    if lora.enabled:
        trained = shape.lora_params(lora) + (shape.hidden + 1 if head == "value" else 0)
        weights, trained_bytes = total * master + trained * 4, trained * 4
    else:
        weights, trained_bytes = total * master, total * master
    weights, grads, moments = weights // shard, trained_bytes // shard, 2 * trained_bytes // shard
    if fsdp.param_offload:
        return {"host:weights": weights, "host:gradients": grads, "host:optimizer": moments}, {}
    if fsdp.optimizer_offload:
        return {"weights": weights, "host:optimizer": moments}, {"gradients": grads, "optimizer": moments}
    return {"weights": weights, "optimizer": moments}, {"gradients": grads}


def _named(prefix: str, parts: dict[str, int]) -> dict[str, int]:
    """``parts`` named ``prefix name`` (``host:prefix name`` for what is on the host)."""
    return {
        (f"host:{prefix} {k[5:]}" if k.startswith("host:") else f"{prefix} {k}"): v for k, v in parts.items()
    }


def _working(shape: ModelShape, compute_bytes: int, head: Any) -> int:
    """Unsharded compute-dtype copies while a model computes: its root and two layers."""
    return compute_bytes * (shape.root_params(head) + 2 * shape.layer_params())


def _longest(cfg: ExperimentConfig) -> int:
    return cfg.rollout.prompt_length + cfg.rollout.response_length


def _rank_rows(cfg: ExperimentConfig, prompts: int, sp: int) -> int:
    """Rows one data-parallel rank holds of ``prompts`` prompts (x ``rollout.n``)."""
    dp = max(1, cfg.resources.nprocs // sp)
    return -(-prompts * cfg.rollout.n // dp)


def micro_batch_tokens(cfg: ExperimentConfig, section: str) -> dict[str, int]:
    """Tokens of one rank's largest micro-batch: ``update`` and ``forward`` of ``section`` (actor,
    critic; the actor's ``forward`` is its log-prob pass, ``ref`` the reference's): a packed
    budget, or padded rows x the longest row; never more than the rank's mini-batch (batch);
    ``teacher`` the distillation teacher's, 0 without one."""
    longest, data = _longest(cfg), cfg.data
    if section == "actor":
        a, ref = cfg.actor, cfg.ref
        sp, packed = a.sequence_parallel_size, a.use_dynamic_bsz
        update = a.update_tokens if packed else a.ppo_micro_batch_size_per_gpu * longest
        forward = a.log_prob_tokens if packed else a.log_prob_micro_batch_size_per_gpu * longest
        ref_packed = packed if ref.log_prob_use_dynamic_bsz is None else ref.log_prob_use_dynamic_bsz
        if ref_packed:
            ref_tokens = ref.log_prob_max_token_len_per_gpu or a.log_prob_tokens
        else:
            ref_tokens = ref.log_prob_micro_batch_size_per_gpu * longest
        teacher = cfg.teacher
        if teacher is None:
            teacher_tokens = 0
        elif packed:  # the teacher takes the actor's layout (ppoflow.workers.teacher)
            teacher_tokens = teacher.log_prob_max_token_len_per_gpu or a.log_prob_tokens
        else:
            teacher_tokens = teacher.log_prob_micro_batch_size_per_gpu * longest
        mini = a.ppo_mini_batch_size
    else:
        c = cfg.critic
        sp, packed = c.sequence_parallel_size, c.packed
        update = c.update_tokens if packed else c.ppo_micro_batch_size_per_gpu * longest
        forward = c.forward_tokens if packed else c.forward_micro_batch_size_per_gpu * longest
        ref_tokens, teacher_tokens, mini = 0, 0, c.ppo_mini_batch_size
    cap_update = -(-_rank_rows(cfg, mini, sp) * longest // sp)
    cap_batch = -(-_rank_rows(cfg, data.train_batch_size, sp) * longest // sp)
    return {
        "update": min(update, cap_update),
        "forward": min(forward, cap_batch),
        "ref": min(ref_tokens, cap_batch),
        "teacher": min(teacher_tokens, cap_batch),
    }


def _teacher(cfg: ExperimentConfig, shape: ModelShape, tokens: int) -> tuple[dict[str, int], int]:
    """The teacher on one actor rank: (its weights, under a ``host:`` name when offloaded; its
    forward's peak above them: unsharded copies, LM-head chunk, one micro-batch's activations)."""
    teacher = cfg.teacher
    assert teacher is not None  # teacher_in_use: the config requires one
    model, fsdp = teacher.model, teacher.fsdp
    weights = shape.params("lm") * DTYPE_BYTES[model.dtype] // _shard(cfg, fsdp)
    compute = DTYPE_BYTES[fsdp.param_dtype or model.dtype]
    path = activation_path(cfg.resources.device, bool(model.use_torch_compile), cfg.actor.use_dynamic_bsz)
    chunk = cfg.actor.logprob_chunk_size * shape.vocab * 4
    forward = _working(shape, compute, "lm") + chunk + tokens * forward_bytes_per_token(shape, compute, path)
    return {("host:teacher weights" if fsdp.param_offload else "teacher weights"): weights}, forward


def _policy_group(
    cfg: ExperimentConfig, shape: ModelShape, capacity: int | None, teacher: ModelShape | None = None
) -> GroupPlan:
    """The actor group's rank: actor, reference, engine (Long because each part has its rule, and
    the rules read best in the order the stages run them)."""
    g = GroupPlan("actor")
    a, model = cfg.actor, cfg.model
    compute = DTYPE_BYTES[a.fsdp.param_dtype or model.dtype]
    path = activation_path(cfg.resources.device, bool(model.use_torch_compile), a.use_dynamic_bsz)
    held, update_only = _trained_state(cfg, shape, model, a.fsdp, a.lora, "lm")
    g.parts.update(_named("actor", held))
    if needs_reference(cfg) and not a.lora.enabled:
        ref_w = shape.params("lm") * DTYPE_BYTES[model.dtype] // _shard(cfg, cfg.ref.fsdp)
        g.parts["host:reference weights" if cfg.ref.fsdp.param_offload else "reference weights"] = ref_w
    tokens = micro_batch_tokens(cfg, "actor")
    teacher_forward = 0
    if teacher is not None:
        teacher_weights, teacher_forward = _teacher(cfg, teacher, tokens["teacher"])
        g.parts.update(teacher_weights)
    engine_on = not cfg.asynchronous.enable or bool(cfg.data.val_files)
    engine = engine_memory(cfg, shape, capacity) if engine_on else {}
    level = (
        engine_sleep_level_of(cfg)
        if cfg.resources.device == "cuda" and engine_spec(cfg.rollout.engine).can("sleep")
        else 0
    )
    resident = sum(v for k, v in g.parts.items() if not k.startswith("host:"))
    asleep = 0
    if engine and level == 0:
        asleep = engine.get("weights", 0) + engine["kv_cache"]
    elif engine and level == 1:
        g.parts["host:engine weights (asleep)"] = engine.get("weights", 0)
    g.parts.update({f"engine {k}": v for k, v in engine.items()})
    chunk = a.logprob_chunk_size * shape.vocab * 4
    working = _working(shape, compute, "lm") + chunk
    forward = forward_bytes_per_token(shape, compute, path)
    per_token = activation_bytes_per_token(shape, compute, path, model.enable_gradient_checkpointing)
    g.parts.update(
        {
            f"actor update activations ({tokens['update']} tokens)": tokens["update"] * per_token,
            "LM-head chunk and unsharded copies": working,
        }
    )
    g.parts.update({f"actor update {k}": v for k, v in update_only.items()})
    if teacher_forward:
        g.parts[f"teacher forward ({tokens['teacher']} tokens)"] = teacher_forward
    log_probs = max(tokens["forward"], tokens["ref"] if needs_reference(cfg) else 0)
    g.stages = {
        "generate": resident + sum(engine.values()),
        "log_probs": resident + asleep + max(working + log_probs * forward, teacher_forward),
        "update": resident + asleep + working + sum(update_only.values()) + tokens["update"] * per_token,
    }
    g.resident = resident + asleep
    g.host = sum(v for k, v in g.parts.items() if k.startswith("host:"))
    return g


def _critic_group(cfg: ExperimentConfig, shape: ModelShape) -> GroupPlan:
    g = GroupPlan("critic")
    c, model = cfg.critic, cfg.critic_model
    compute = DTYPE_BYTES[c.fsdp.param_dtype or model.dtype]
    held, update_only = _trained_state(cfg, shape, model, c.fsdp, c.lora, "value")
    g.parts.update(_named("critic", held))
    tokens = micro_batch_tokens(cfg, "critic")
    path = activation_path(cfg.resources.device, bool(model.use_torch_compile), c.packed)
    per_token = activation_bytes_per_token(shape, compute, path, model.enable_gradient_checkpointing)
    working = _working(shape, compute, "value")
    g.parts[f"critic update activations ({tokens['update']} tokens)"] = tokens["update"] * per_token
    g.parts.update({f"critic update {k}": v for k, v in update_only.items()})
    resident = sum(v for k, v in held.items() if not k.startswith("host:"))
    forward = tokens["forward"] * forward_bytes_per_token(shape, compute, path)
    g.stages = {
        "generate": resident,
        "log_probs": resident + working + forward,
        "update": resident + working + sum(update_only.values()) + tokens["update"] * per_token,
    }
    g.resident = resident
    g.host = sum(v for k, v in held.items() if k.startswith("host:"))
    return g


def _reward_group(cfg: ExperimentConfig, shape: ModelShape) -> GroupPlan:
    rm = cfg.reward.reward_model
    assert rm.model is not None  # the config requires it when enabled
    compute = DTYPE_BYTES[rm.fsdp.param_dtype or rm.model.dtype]
    weights = shape.params("value") * DTYPE_BYTES[rm.model.dtype] // _shard(cfg, rm.fsdp)
    longest = rm.max_length or _longest(cfg)
    packed = rm.use_dynamic_bsz
    tokens = rm.forward_max_token_len_per_gpu if packed else rm.micro_batch_size_per_gpu * longest
    tokens = min(tokens, _rank_rows(cfg, cfg.data.train_batch_size, 1) * longest)
    path = activation_path(cfg.resources.device, bool(rm.model.use_torch_compile), bool(packed))
    forward = tokens * forward_bytes_per_token(shape, compute, path)
    g = GroupPlan("reward_model", parts={"reward model weights": weights}, resident=weights)
    g.stages = {"generate": weights, "log_probs": weights + _working(shape, compute, "value") + forward}
    g.stages["update"] = weights
    return g


def memory_plan(
    cfg: ExperimentConfig,
    shapes: dict[str, ModelShape],
    capacity: int | None = None,
    cpu_process_bytes: dict[str, int] | None = None,
) -> MemoryPlan:
    """The plan of ``cfg`` (module docstring) from the models' shapes: ``policy``, and ``critic``,
    ``reward_model`` and ``teacher`` where those run (KeyError when one is missing); ``capacity``:
    one device's bytes, which the auto KV cache's cap and ``kv_cache_gib: null`` read;
    ``cpu_process_bytes``: on CPU ranks, each role's rank runtime (0 where not given)."""
    teacher = shapes["teacher"] if teacher_in_use(cfg) else None
    groups = [_policy_group(cfg, shapes["policy"], capacity, teacher)]
    if cfg.critic.enable:
        groups.append(_critic_group(cfg, shapes["critic"]))
    if cfg.reward.reward_model.enable:
        groups.append(_reward_group(cfg, shapes["reward_model"]))
    cuda = cfg.resources.device == "cuda"
    roles = ("actor", "critic", "reward_model")
    process = {r: CUDA_PROCESS_BYTES for r in roles} if cuda else {r: 0 for r in roles}
    if not cuda and cpu_process_bytes:
        process.update(cpu_process_bytes)
    tokens = {f"actor {k}": v for k, v in micro_batch_tokens(cfg, "actor").items()}
    if cfg.critic.enable:
        tokens.update({f"critic {k}": v for k, v in micro_batch_tokens(cfg, "critic").items()})
    return MemoryPlan(
        device=cfg.resources.device,
        groups=groups,
        ranks_per_device=1 if cuda else cfg.resources.nprocs,
        process_bytes=process,
        capacity=capacity,
        tokens=tokens,
    )
