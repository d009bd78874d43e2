"""Rollout engines by name: the one place an engine is declared, with what it can do.

    register_engine(EngineSpec(
        name="vllm",
        engine="ppoflow.workers.rollout.vllm_rollout:VLLMRollout",
        sharding_manager="ppoflow.workers.rollout.sharding_manager:FSDPVLLMShardingManager",
        lora_sharding_manager="ppoflow.workers.rollout.lora_sync:LoRAShardingManager",
        capabilities=frozenset({"tensor_parallel", "multi_turn", "weight_push", "adapter_sync", "sleep"}),
        max_lora_rank=512,
    ))

The config validates ``rollout.engine`` against these names and refuses settings the engine lacks
the capability for (``ppoflow.infra.config``); the ranks build the engine and its sharding manager
from the import paths (``ppoflow.workers.rollout.build_rollout``/``build_sharding_manager``); every
engine-specific branch asks a capability (``spec.can("adapter_sync")``), never a name. A spec holds
import paths only, so the flow process validates configs without importing worker code or vLLM:
:meth:`EngineSpec.load` is for the ranks.

Capabilities (:data:`CAPABILITIES`), and the settings that need them:

    tensor_parallel      one engine over several ranks (rollout.tensor_model_parallel_size > 1)
    multi_turn           samples one turn of many episodes (Rollout.sample_turn; rollout.multi_turn)
    weight_push          holds its own copy of the weights, pushed from the actor by its sharding
                         manager (rollout.weight_loader); without it the engine generates with the
                         actor's live module and its manager has nothing to do
    adapter_sync         serves the policy's LoRA adapter over frozen base weights (actor.lora.sync:
                         adapter); with weight_push and without it, LoRA policies sync merged
    sleep                frees its device memory between rollouts (rollout.sleep_level; its manager
                         has ``sleep()``)
    always_log_probs     returns the sampler's log-probs (rollout_log_probs) on every call, not only
                         with rollout.calculate_log_probs
    collective_generate  each generate call is a collective over all ranks: every rank makes the
                         same number of calls (multi-turn keeps ranks without episodes calling)

The engine class (a ``ppoflow.workers.rollout.base.Rollout``) builds itself with
``from_config(config, site, **engine_kwargs)``; a manager class is built as
``Manager(engine, actor_module, **settings)``; ``docs/internals.md`` ("Adding a rollout engine")
has the whole contract.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

__all__ = [
    "CAPABILITIES",
    "EngineSpec",
    "register_engine",
    "engine_spec",
    "engine_names",
    "engines_with",
]

#: What each capability is, as the config's errors say it.
CAPABILITIES: dict[str, str] = {
    "tensor_parallel": "one engine over several ranks",
    "multi_turn": "samples the turns of multi-turn episodes: Rollout.sample_turn",
    "weight_push": "weights of its own, pushed from the actor by its sharding manager",
    "adapter_sync": "serves a LoRA adapter over frozen base weights",
    "sleep": "frees its device memory between rollouts",
    "always_log_probs": "returns the sampler's log-probs on every call",
    "collective_generate": "each generate call is a collective over all ranks",
    "step_budget": "schedules prompts under rollout.max_num_batched_tokens a step (whole prompts on CPU)",
}


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One rollout engine (see the module docstring).

    Attributes:
        name: the value of ``rollout.engine``.
        engine: import path (``package.module:Class``) of its ``Rollout`` class.
        sharding_manager: import path of its sharding manager class.
        capabilities: names from :data:`CAPABILITIES`.
        lora_sharding_manager: import path of the manager used for a policy with LoRA adapters;
            None: ``sharding_manager`` serves those too.
        max_lora_rank: the largest LoRA rank the engine serves (None: no limit).
        preload: modules the ranks that build the engine import anyway, which a CPU group's
            launcher imports once before it forks them (``ppoflow.infra.remote.rank.launch``):
            each rank then starts with them loaded instead of importing them itself.
    """

    name: str
    engine: str
    sharding_manager: str
    capabilities: frozenset[str] = frozenset()
    lora_sharding_manager: str | None = None
    max_lora_rank: int | None = None
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
        unknown = sorted(self.capabilities - CAPABILITIES.keys())
        if unknown:
            raise ValueError(
                f"rollout engine {self.name!r} declares unknown capabilities {unknown}; "
                f"known: {', '.join(sorted(CAPABILITIES))}"
            )
        for field in ("engine", "sharding_manager", "lora_sharding_manager"):
            path = getattr(self, field)
            if path is not None and (path.count(":") != 1 or not all(path.split(":"))):
                raise ValueError(
                    f"rollout engine {self.name!r}: {field}={path!r} is not an import path "
                    "'package.module:Name'"
                )

    def can(self, capability: str) -> bool:
        """Whether the engine has ``capability`` (a name from :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise KeyError(f"unknown rollout engine capability {capability!r}; known: {sorted(CAPABILITIES)}")
        return capability in self.capabilities

    def require(self, capability: str, setting: str, fix: str) -> None:
        """ValueError naming the engine, the ``setting`` that needs ``capability`` and ``fix``,
        unless the engine has it."""
        if self.can(capability):
            return
        able = engines_with(capability)
        raise ValueError(
            f"{setting} needs an engine with {capability} ({CAPABILITIES[capability]}); "
            f"rollout.engine={self.name!r} has no {capability}: {fix}"
            + (f", or use rollout.engine {' or '.join(map(repr, able))}" if able else "")
        )

    def load(self, path: str | None = None) -> Any:
        """Import the object at ``path`` (default: the engine class). For the ranks: the flow
        process never imports worker code."""
        module, _, name = (path or self.engine).partition(":")
        return getattr(importlib.import_module(module), name)


_ENGINES: dict[str, EngineSpec] = {}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add ``spec`` (or replace the engine of the same name); returns it."""
    if not isinstance(spec, EngineSpec):
        raise TypeError(f"register_engine needs an EngineSpec, got {spec!r}")
    _ENGINES[spec.name] = spec
    return spec


def engine_names() -> list[str]:
    """The registered engines' names, sorted."""
    return sorted(_ENGINES)


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine ``name``; ValueError listing the registered names when there is none."""
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown rollout engine {name!r}; allowed: {', '.join(engine_names())}") from None


def engines_with(capability: str) -> list[str]:
    """The names of the engines that have ``capability``, sorted."""
    return [name for name in engine_names() if _ENGINES[name].can(capability)]


# The built-in engines, each declared here once and nowhere else.
# vllm: a vLLM engine inside each rank (SPMD), the actor's weights pushed into it before a rollout.
register_engine(
    EngineSpec(
        name="vllm",
        engine="ppoflow.workers.rollout.vllm_rollout:VLLMRollout",
        sharding_manager="ppoflow.workers.rollout.sharding_manager:FSDPVLLMShardingManager",
        lora_sharding_manager="ppoflow.workers.rollout.lora_sync:LoRAShardingManager",
        capabilities=frozenset(
            {"tensor_parallel", "multi_turn", "weight_push", "adapter_sync", "sleep", "step_budget"}
        ),
        max_lora_rank=512,
        # ~6 CPU-seconds a rank on a 2-core x86 host; the engine's start imports little more
        preload=("vllm.entrypoints.llm",),
    )
)
# hf: transformers generate on the actor's own FSDP module (no vLLM, no second copy of the weights).
register_engine(
    EngineSpec(
        name="hf",
        engine="ppoflow.workers.rollout.hf_rollout:HFRollout",
        sharding_manager="ppoflow.workers.rollout.sharding_manager:NoOpShardingManager",
        capabilities=frozenset({"multi_turn", "always_log_probs", "collective_generate"}),
    )
)
