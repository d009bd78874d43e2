"""Rollout engines and the weight sync between the FSDP actor and the engine.

    rollout = build_rollout(config, model_path=..., tokenizer=tok, actor_module=module,
                            device="cpu", rank=rank, world_size=world_size)
    manager = build_sharding_manager(rollout, module)
    manager.set_source_checkpoint(url)            # or set_source_live() after update_actor
    with manager:                                 # pushes the actor's weights into the engine
        out = rollout.generate_sequences(prompts) # DataProto: prompts, responses, ... rollout_log_probs
    metrics["weight_sync_s"] = manager.last_sync_s

``rollout.engine`` names an engine of the registry ``ppoflow.infra.models.rollout_engines``, which gives
its class and sharding manager by import path and its capabilities; both builders here resolve
them from it (no engine is named in this package's code). The built-in engines: ``vllm``
(``VLLMRollout``: a vLLM engine inside each rank, SPMD, TP from
``rollout.tensor_model_parallel_size``; ``FSDPVLLMShardingManager`` pushes the weights, and
``LoRAShardingManager`` for a LoRA policy) and ``hf`` (``HFRollout``: transformers generate on the
actor's own FSDP module; ``NoOpShardingManager``). Both give the same output columns; see
``ppoflow.workers.rollout.base``. With ``rollout.multi_turn.enable`` the engine is wrapped in
``MultiTurnRollout`` (``ppoflow.workers.rollout.multiturn``): episodes with an environment.
"""

from __future__ import annotations

from typing import Any

from ppoflow.infra.models.rollout_engines import engine_spec
from ppoflow.workers.rollout.base import EngineSite, Rollout, SamplingSettings

__all__ = ["build_rollout", "build_sharding_manager", "Rollout", "SamplingSettings", "EngineSite"]


def build_rollout(
    config: Any,
    *,
    model_path: str,
    tokenizer: Any,
    actor_module: Any,
    device: str,
    rank: int,
    world_size: int,
    **engine_kwargs: Any,
) -> Rollout:
    """The rollout engine of ``config.rollout.engine`` for this rank.

    Args:
        config: the ``ExperimentConfig`` (or its JSON dict).
        model_path: HF model directory the engine is built from (vLLM loads its architecture).
        tokenizer: the HF tokenizer (pad/eos ids).
        actor_module: the FSDP policy (engines without ``weight_push`` generate with it).
        device, rank, world_size: this rank.
        engine_kwargs: passed to the engine's ``from_config`` (vLLM: ``load_format``,
            ``engine_kwargs``, ``sequences``: default each replica's share of
            ``data.train_batch_size * rollout.n``).
    """
    from ppoflow.infra.config import ExperimentConfig

    if isinstance(config, dict):
        config = ExperimentConfig.model_validate(config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token: responses cannot be padded")
    site = EngineSite(
        model_path=model_path,
        tokenizer=tokenizer,
        actor_module=actor_module,
        device=device,
        rank=rank,
        world_size=world_size,
        pad_token_id=int(pad),
    )
    spec = engine_spec(config.rollout.engine)
    engine = spec.load().from_config(config, site, **engine_kwargs)
    engine.spec = spec
    if not config.rollout.multi_turn.enable:
        return engine
    from ppoflow.workers.rollout.multiturn import MultiTurnRollout

    return MultiTurnRollout(engine, config.rollout, tokenizer, reward_function=config.reward.custom_function)


def build_sharding_manager(rollout: Rollout, actor_module: Any, **kwargs: Any):
    """The sharding manager of ``rollout``'s engine (its spec's ``sharding_manager``), or for a
    policy with LoRA adapters (``kwargs`` has ``lora_sync``) its ``lora_sharding_manager`` when it
    has one.

    Every manager is built as ``Manager(engine, actor_module, **kwargs)``; ``kwargs``: ``loader``,
    ``sleep_level``, ``storage_options``, ``quiet``, ``verify`` (a manager takes what applies to it), and for
    the LoRA manager ``lora_sync`` (as ``sync``) and ``base_model``.
    """
    engine = getattr(rollout, "engine", rollout)  # a MultiTurnRollout's manager is its engine's
    spec = engine.spec
    lora_sync = kwargs.pop("lora_sync", None)
    base_model = kwargs.pop("base_model", None)
    if lora_sync is not None and spec.lora_sharding_manager is not None:
        manager = spec.load(spec.lora_sharding_manager)
        return manager(engine, actor_module, sync=lora_sync, base_model=base_model, **kwargs)
    return spec.load(spec.sharding_manager)(engine, actor_module, **kwargs)
