"""Rollout engines and the weight sync between the FSDP actor and the engine.

    rollout = build_rollout(config, model_path=..., tokenizer=tok, actor_module=module,
                            device="cpu", rank=rank, world_size=world_size)
    manager = build_sharding_manager(rollout, module)
    manager.set_source_checkpoint(url)            # or set_source_live() after update_actor
    with manager:                                 # pushes the actor's weights into the engine
        out = rollout.generate_sequences(prompts) # DataProto: prompts, responses, ... rollout_log_probs
    metrics["weight_sync_s"] = manager.last_sync_s

Engines (``rollout.engine``): ``vllm`` (``VLLMRollout``: a vLLM engine inside each rank, SPMD,
TP from ``rollout.tensor_model_parallel_size``) and ``hf`` (``HFRollout``: transformers generate on
the actor's own FSDP module; its manager is a no-op). Both give the same output columns; see
``ppoflow.workers.rollout.base``. With ``rollout.multi_turn.enable`` the engine is wrapped in
``MultiTurnRollout`` (``ppoflow.workers.rollout.multiturn``): episodes with an environment.
"""

from __future__ import annotations

from typing import Any

from ppoflow.workers.rollout.base import Rollout, SamplingSettings

__all__ = ["build_rollout", "build_sharding_manager", "Rollout", "SamplingSettings"]


def _eos_ids(tokenizer: Any, model_path: str) -> list[int]:
    """EOS ids: the tokenizer's, plus the model's generation config's (as vLLM stops on both)."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        extra = gen.eos_token_id
        for i in [extra] if isinstance(extra, int) else (extra or []):
            if int(i) not in ids:
                ids.append(int(i))
    except (OSError, ValueError):
        pass
    return ids


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
        actor_module: the FSDP policy (HFRollout generates with it; vLLM ignores it here).
        device, rank, world_size: this rank.
        engine_kwargs: passed to ``VLLMRollout`` (``load_format``, ``engine_kwargs``, ``sequences``:
            default each replica's share of ``data.train_batch_size * rollout.n``).
    """
    from ppoflow.infra.config import ExperimentConfig

    if isinstance(config, dict):
        config = ExperimentConfig.model_validate(config)
    engine = _build_engine(
        config,
        model_path=model_path,
        tokenizer=tokenizer,
        actor_module=actor_module,
        device=device,
        rank=rank,
        world_size=world_size,
        **engine_kwargs,
    )
    if not config.rollout.multi_turn.enable:
        return engine
    from ppoflow.workers.rollout.multiturn import MultiTurnRollout

    return MultiTurnRollout(engine, config.rollout, tokenizer, reward_function=config.reward.custom_function)


def _build_engine(
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
    """The engine of ``config.rollout.engine`` (an ``ExperimentConfig``)."""
    rcfg = config.rollout
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token: responses cannot be padded")
    if rcfg.engine == "hf":
        from ppoflow.workers.rollout.hf_rollout import HFRollout

        if actor_module is None:
            raise ValueError("rollout.engine=hf generates with the actor module: pass actor_module")
        return HFRollout(
            rcfg,
            actor_module,
            eos_token_id=_eos_ids(tokenizer, model_path),
            pad_token_id=pad,
            rank=rank,
            world_size=world_size,
            device=device,
        )
    from ppoflow.workers.rollout.vllm_rollout import VLLMRollout

    replicas = max(1, world_size // rcfg.tensor_model_parallel_size)
    engine_kwargs.setdefault("sequences", -(-config.data.train_batch_size * rcfg.n // replicas))
    return VLLMRollout(
        rcfg,
        model_path=model_path,
        rank=rank,
        world_size=world_size,
        dtype=rcfg.dtype or config.model.dtype,
        tokenizer_path=config.model.tokenizer_path or model_path,
        pad_token_id=pad,
        trust_remote_code=config.model.trust_remote_code,
        **engine_kwargs,
    )


def build_sharding_manager(rollout: Rollout, actor_module: Any, **kwargs: Any):
    """``FSDPVLLMShardingManager`` for a vLLM rollout, a no-op manager for the HF rollout.

    ``kwargs`` go to ``FSDPVLLMShardingManager`` (``loader``, ``sleep_level``, ``storage_options``,
    ``quiet``). A policy with LoRA adapters gets ``lora_sync.LoRAShardingManager`` (``kwargs``
    also ``lora_sync`` and ``base_model``).
    """
    rollout = getattr(rollout, "engine", rollout)  # a MultiTurnRollout's manager is its engine's
    lora_sync = kwargs.pop("lora_sync", None)
    base_model = kwargs.pop("base_model", None)
    if getattr(rollout, "engine_name", None) == "vllm" and lora_sync is not None:
        from ppoflow.workers.rollout.lora_sync import LoRAShardingManager

        return LoRAShardingManager(rollout, actor_module, sync=lora_sync, base_model=base_model, **kwargs)
    if getattr(rollout, "engine_name", None) == "vllm":
        from ppoflow.workers.rollout.sharding_manager import FSDPVLLMShardingManager

        return FSDPVLLMShardingManager(rollout, actor_module, **kwargs)
    from ppoflow.workers.rollout.sharding_manager import NoOpShardingManager

    return NoOpShardingManager()
