"""veRL's keys (its ``ppo_trainer`` config at commit b178a3cd, DAPO's recipe keys and their older
spellings) and what each is here: **mapped** onto a ppoflow setting (:data:`MAPPED`, with the
setting), **checked** (:data:`CHECKED`: a value ppoflow does anyway is accepted and nothing is set,
any other refused with the reason), or **ignored** (:data:`IGNORED`, with the reason: no meaning
here). A key in none of them is not a veRL key: refused, naming the nearest one (:func:`nearest`).

An entry ending in ``.*`` covers every key below it; ``_target_`` (the class Hydra builds a section
into) is ignored anywhere. docs/verl.md has these tables as a reader wants them.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

__all__ = [
    "MAPPED",
    "CHECKED",
    "IGNORED",
    "LEAVES",
    "VERL_DEFAULTS",
    "ignored_reason",
    "is_known",
    "matches",
    "nearest",
]


def _expand(spec: str) -> list[str]:
    """``"a.{b,c}.d"`` -> ``["a.b.d", "a.c.d"]`` (one brace group, or none)."""
    m = re.search(r"\{([^}]*)\}", spec)
    if m is None:
        return [spec]
    return [x for part in m.group(1).split(",") for x in _expand(spec[: m.start()] + part + spec[m.end() :])]


def _rows(rows: dict[str, Any]) -> dict[str, Any]:
    return {key: value for spec, value in rows.items() for key in _expand(spec)}


ARO = "actor_rollout_ref"
A, REF, R, M = f"{ARO}.actor", f"{ARO}.ref", f"{ARO}.rollout", f"{ARO}.model"

#: veRL key -> the ppoflow setting it becomes (what docs/verl.md's table says).
MAPPED: dict[str, str] = _rows(
    {
        "data.{train_files,val_files,prompt_key,train_batch_size,shuffle,seed,truncation}": "data.*",
        "data.filter_overlong_prompts": "data.filter_overlong_prompts",
        "data.max_prompt_length": "rollout.prompt_length",
        "data.max_response_length": "rollout.response_length",
        "data.gen_batch_size": "algorithm.dynamic_sampling.max_rounds (with filter_groups)",
        "data.val_max_samples": "evaluation.max_prompts (data.shuffle=false)",
        f"{M}.{{path,tokenizer_path,trust_remote_code,enable_gradient_checkpointing}}": "model.*",
        f"{M}.override_config": "model.override_config",
        f"{M}.override_config.*": "model.override_config.*",
        f"{M}.lora_rank": "actor.lora.rank",
        f"{M}.lora_alpha": "actor.lora.alpha",
        f"{M}.target_modules": "actor.lora.target_modules",
        f"{A}.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
        f"{A}.clip_ratio": "actor.clip_ratio_low, clip_ratio_high (where veRL's are null)",
        f"{A}.clip_ratio_low": "actor.clip_ratio_low",
        f"{A}.clip_ratio_high": "actor.clip_ratio_high",
        f"{A}.{{clip_ratio_c,loss_agg_mode,entropy_coeff,use_kl_loss,kl_loss_coef,kl_loss_type}}": "actor.*",
        f"{A}.{{ppo_epochs,shuffle}}": "actor.*",
        f"{A}.policy_loss.loss_mode": "actor.policy_loss",
        f"{A}.ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
        f"{A}.fsdp_config.ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
        f"{A}.grad_clip": "actor.optim.grad_clip",
        f"{A}.optim.{{lr,weight_decay,betas}}": "actor.optim.*",
        f"{A}.optim.clip_grad": "actor.optim.grad_clip",
        f"{A}.fsdp_config.{{param_offload,optimizer_offload,reshard_after_forward,fsdp_size}}": "actor.fsdp.*",
        f"{A}.fsdp_config.dtype": "actor.fsdp.param_dtype",
        f"{A}.fsdp_config.model_dtype": "model.dtype",
        f"{{{A},critic.model}}.fsdp_config.full_determinism": "resources.deterministic",
        f"{REF}.fsdp_config.{{param_offload,reshard_after_forward,fsdp_size}}": "ref.fsdp.*",
        f"{REF}.fsdp_config.dtype": "ref.fsdp.param_dtype",
        f"{REF}.ulysses_sequence_parallel_size": "ref.sequence_parallel_size",
        f"{R}.name": "rollout.engine",
        f"{R}.{{n,temperature,top_p,top_k,dtype,tensor_model_parallel_size,calculate_log_probs}}": "rollout.*",
        f"{R}.prompt_length": "rollout.prompt_length",
        f"{R}.response_length": "rollout.response_length",
        f"{R}.val_kwargs.{{n,temperature,top_p,top_k}}": "evaluation.*",
        f"{R}.val_kwargs.do_sample": "evaluation.temperature (false: 0, greedy)",
        "critic.enable": "critic.enable (null: left to ppoflow, on exactly for gae)",
        "critic.{ppo_mini_batch_size,ppo_epochs,shuffle,cliprange_value,loss_agg_mode}": "critic.*",
        "critic.ulysses_sequence_parallel_size": "critic.sequence_parallel_size",
        "critic.grad_clip": "critic.optim.grad_clip",
        "critic.optim.{lr,weight_decay,betas}": "critic.optim.*",
        "critic.optim.clip_grad": "critic.optim.grad_clip",
        "critic.model.{path,tokenizer_path,trust_remote_code,enable_gradient_checkpointing}": "critic.model.*",
        "critic.model.override_config": "critic.model.override_config",
        "critic.model.override_config.*": "critic.model.override_config.*",
        "critic.model.lora_rank": "critic.lora.rank",
        "critic.model.lora_alpha": "critic.lora.alpha",
        "critic.model.target_modules": "critic.lora.target_modules",
        "critic.model.fsdp_config.{param_offload,optimizer_offload,reshard_after_forward,fsdp_size}": "critic.fsdp.*",
        "critic.model.fsdp_config.dtype": "critic.fsdp.param_dtype",
        "critic.model.fsdp_config.model_dtype": "critic.model.dtype",
        "reward_model.enable": "reward.reward_model.enable (and reward.rule off: its score replaces the rule's)",
        "reward_model.model.{path,trust_remote_code,override_config,override_config.*}": "reward.reward_model.model.*",
        "reward_model.model.fsdp_config.{param_offload,reshard_after_forward,fsdp_size}": "reward.reward_model.fsdp.*",
        "reward_model.max_length": "reward.reward_model.max_length",
        "reward_model.reward_manager": "reward.overlong_buffer (dapo applies it; naive and dapo score by rule)",
        "reward_model.{overlong_buffer,reward_kwargs.overlong_buffer_cfg}.enable": "reward.overlong_buffer.enable",
        "reward_model.{overlong_buffer.len,reward_kwargs.overlong_buffer_cfg.len}": "reward.overlong_buffer.length",
        "reward_model.{overlong_buffer,reward_kwargs.overlong_buffer_cfg}.penalty_factor": "reward.overlong_buffer.penalty_factor",
        "reward_manager.name": "reward.overlong_buffer.enable (dapo)",
        "custom_reward_function.{path,name}": "reward.custom_function ('path:name')",
        "algorithm.{adv_estimator,gamma,lam,norm_adv_by_std_in_grpo,use_kl_in_reward,kl_penalty}": "algorithm.*",
        "algorithm.kl_ctrl.{type,kl_coef,horizon,target_kl}": "algorithm.kl_ctrl.*",
        "algorithm.rollout_correction.rollout_is": "algorithm.rollout_correction.tis",
        "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_correction.tis_cap",
        "algorithm.rollout_correction.rollout_rs": "algorithm.rollout_correction.mis (and mis_normaliser: kept)",
        "algorithm.rollout_correction.rollout_rs_threshold": "algorithm.rollout_correction.mis_lower, mis_upper",
        "algorithm.rollout_correction.bypass_mode": "algorithm.rollout_correction.behaviour",
        "algorithm.filter_groups.enable": "algorithm.dynamic_sampling.enable",
        "algorithm.filter_groups.metric": "algorithm.dynamic_sampling (the score it compares)",
        "algorithm.filter_groups.max_num_gen_batches": "algorithm.dynamic_sampling.max_rounds",
        "trainer.{total_epochs,total_training_steps}": "the iterations `ppoflow run` runs to",
        "trainer.logger": "tracking.wandb (project: trainer.project_name, name: trainer.experiment_name) when it names wandb",
        "trainer.project_name": "storage.root (checkpoints/<project_name>)",
        "trainer.experiment_name": "storage.experiment",
        "trainer.default_local_dir": "storage.root and storage.experiment",
        "trainer.n_gpus_per_node": "resources.nprocs",
        "trainer.device": "resources.device",
        "trainer.save_freq": "checkpoint.snapshot_every (-1: only at the end of each run)",
        "trainer.test_freq": "evaluation.every, evaluation.at_end",
        "trainer.val_before_train": "evaluation.before_training",
        "trainer.{max_actor_ckpt_to_keep,max_critic_ckpt_to_keep}": "checkpoint.keep_last",
        "trainer.resume_mode": "auto: continue the experiment; disable: only a new one",
    }
)

_NOT = "ppoflow has no such setting"
#: veRL key -> (values accepted: ppoflow does this anyway, nothing is set; why any other is refused).
CHECKED: dict[str, tuple[tuple[Any, ...], str]] = _rows(
    {
        f"{{{A},{REF},critic,reward_model}}.strategy": (
            ("fsdp", "fsdp2"),
            "ppoflow trains with PyTorch FSDP2 only (no Megatron)",
        ),
        f"{{{A},{REF}}}.fsdp_config.strategy": (("fsdp", "fsdp2"), "ppoflow trains with PyTorch FSDP2 only"),
        "critic.model.fsdp_config.strategy": (("fsdp", "fsdp2"), "ppoflow trains with PyTorch FSDP2 only"),
        f"{{{A},critic}}.optim.optimizer": (("AdamW",), "ppoflow's optimizer is AdamW"),
        f"{{{A},critic}}.optim.optimizer_impl": (("torch.optim",), "ppoflow uses torch.optim.AdamW"),
        f"{{{A},critic}}.optim.lr_scheduler_type": (
            ("constant",),
            "ppoflow's learning rate is constant after its warmup (no cosine schedule)",
        ),
        f"{{{A},critic}}.optim.warmup_style": ((None, "constant"), "ppoflow's schedule is constant"),
        f"{{{A},critic}}.optim.{{lr_warmup_steps,lr_warmup_steps_ratio}}": (
            (-1, 0, 0.0, None),
            "veRL warms up per training step from LR 0 (step k: k/W), ppoflow per optimizer step "
            "from 1/W: not the same schedule (set actor.optim.warmup_steps with --set if that will do)",
        ),
        f"{{{A},critic}}.optim.override_optimizer_config": ((None, {}), "AdamW's other arguments: " + _NOT),
        f"{A}.loss_scale_factor": (
            (None,),
            "ppoflow's seq-mean-token-sum-norm divides by the response length",
        ),
        f"{{{A},{REF}}}.router_replay.mode": (("disabled",), "MoE router replay: " + _NOT),
        f"{REF}.fsdp_config.model_dtype": (
            ("fp32", "float32"),
            "ppoflow's reference holds model.dtype weights",
        ),
        f"{M}.{{hf_config_path,custom_chat_template,external_lib,exclude_modules,lora_adapter_path}}": (
            (None,),
            "ppoflow loads the model, its tokenizer's chat template and fresh adapters as they are: " + _NOT,
        ),
        "critic.model.external_lib": ((None,), "ppoflow imports no extra model library: " + _NOT),
        f"{M}.mtp.enable": ((False,), "multi-token prediction: " + _NOT),
        f"{R}.{{ignore_eos,skip_rollout,enable_rollout_routing_replay}}": ((False,), _NOT),
        f"{R}.do_sample": ((True,), "greedy training rollouts: rollout.temperature must be > 0"),
        f"{R}.logprobs_mode": (("processed_logprobs",), "ppoflow's engine returns processed log-probs"),
        f"{R}.over_sample_rate": ((0, 0.0), "over-sampling partial rollouts: " + _NOT),
        f"{R}.{{data_parallel_size,expert_parallel_size,pipeline_model_parallel_size}}": (
            (1,),
            "ppoflow's engines are data-parallel over the ranks with tensor parallelism only",
        ),
        f"{R}.{{quantization,quantization_config_file}}": ((None,), "quantized rollouts: " + _NOT),
        f"{R}.multi_turn.enable": (
            (False,),
            "ppoflow's multi-turn rollouts use environments of its own (rollout.multi_turn, docs/multiturn.md)",
        ),
        f"{R}.agent.default_agent_loop": (("single_turn_agent",), "agent loops: see docs/multiturn.md"),
        f"{R}.agent.{{agent_loop_config_path,custom_async_server.path}}": ((None,), "agent loops: " + _NOT),
        "data.train_max_samples": ((-1, None), "a subset of the training rows: " + _NOT),
        "data.reward_fn_key": (("data_source",), "ppoflow picks each row's rule by its data_source"),
        "data.tokenizer": ((None,), "ppoflow tokenizes with the model's tokenizer (model.tokenizer_path)"),
        "data.{tool_config_path,custom_cls.path,sampler.class_path,datagen.path}": (
            (None,),
            "custom dataset classes, samplers and tools: " + _NOT,
        ),
        "data.apply_chat_template_kwargs": (({},), "chat-template arguments: " + _NOT),
        "reward_model.reward_loop_module_path": ((None,), "custom reward loops: " + _NOT),
        "reward_model.sandbox_fusion.url": ((None,), "a code sandbox: use reward.remote (docs/tasks.md)"),
        "reward_manager.source": (("register",), "custom reward managers: " + _NOT),
        "reward_manager.module.path": ((None,), "custom reward managers: " + _NOT),
        "algorithm.use_pf_ppo": ((False,), "PF-PPO reweighting: " + _NOT),
        "algorithm.rollout_correction.rollout_is_batch_normalize": (
            (False,),
            "IS weights normalised: " + _NOT,
        ),
        "algorithm.rollout_correction.loss_type": (("ppo_clip",), "the REINFORCE bypass loss: " + _NOT),
        "trainer.nnodes": ((1,), "multi-node runs: resources.launch rendezvous (docs/multinode.md)"),
        "trainer.critic_warmup": ((0,), "actor updates held back while the critic trains: " + _NOT),
        "trainer.val_only": (
            (False,),
            "an evaluation without training is `ppoflow eval` (docs/evaluation.md)",
        ),
        "trainer.{resume_from_path,default_hdfs_dir}": (
            (None,),
            "ppoflow continues the experiment at storage.root/storage.experiment; give that (or an "
            "s3:// root) instead",
        ),
        "actor_rollout_ref.hybrid_engine": ((True,), "ppoflow's engine always shares the actor's ranks"),
    }
)

_SPEED = "speed only: ppoflow packs micro-batches by token budgets of its own (actor.use_dynamic_bsz)"
_KERNEL = (
    "speed or memory only: a kernel, offload or memory option of veRL's; ppoflow picks its own (docs/gpus.md)"
)
_LOADER = "veRL's data loading plumbing: ppoflow reads the parquet files itself"
_ENGINE = "an engine memory or speed knob: ppoflow sizes vLLM for the batch (rollout.kv_cache_gib: auto)"
_OBSERVE = (
    "logging, profiling or tracing: ppoflow keeps metrics and samples on storage, the Prefect UI shows them"
)
_RAY = "placement and plumbing of veRL's Ray workers: ppoflow runs torchrun groups"
_CKPT = "ppoflow's checkpoints always hold the model, the optimizer and the rest of the state"
_COMPILE = "speed only: ppoflow compiles on GPU by default (model.use_torch_compile)"
_MM = "multi-modal inputs: ppoflow trains text models"
_MICRO = "{log_prob_micro_batch_size,log_prob_micro_batch_size_per_gpu,log_prob_use_dynamic_bsz,log_prob_max_token_len_per_gpu}"
_CRIT_MICRO = "{ppo_micro_batch_size,ppo_micro_batch_size_per_gpu,use_dynamic_bsz,ppo_max_token_len_per_gpu,forward_max_token_len_per_gpu,forward_micro_batch_size,forward_micro_batch_size_per_gpu}"
_KERNELS = "{entropy_from_logits_with_chunking,entropy_checkpointing}"
_FSDP_SPEED = "wrap_policy.*,forward_prefetch,use_orig_params,seed,entropy_from_logits_with_chunking,entropy_checkpointing,forward_only"
_COSINE = "read only by the cosine schedule (refused: ppoflow's is constant)"

#: veRL key (or ``prefix.*``) -> why it has no meaning here.
IGNORED: dict[str, str] = _rows(
    {
        f"{A}.{{ppo_micro_batch_size,ppo_micro_batch_size_per_gpu,use_dynamic_bsz,ppo_max_token_len_per_gpu}}": _SPEED,
        f"{{{REF},{R}}}.{_MICRO}": _SPEED,
        f"critic.{_CRIT_MICRO}": _SPEED,
        "reward_model.{micro_batch_size,micro_batch_size_per_gpu,use_dynamic_bsz,forward_max_token_len_per_gpu}": _SPEED,
        f"{{{A},{REF},critic,reward_model}}.{{use_remove_padding,model.use_remove_padding}}": _SPEED,
        f"{M}.use_remove_padding": _SPEED,
        f"{{{A},{REF}}}.{_KERNELS}": "speed only: ppoflow chunks its LM head itself (actor.logprob_head)",
        f"{A}.{{calculate_sum_pi_squared,sum_pi_squared_checkpointing,use_prefix_grouper,use_fused_kernels}}": _KERNEL,
        f"{{{A},{REF}}}.use_torch_compile": _COMPILE,
        f"{{{A},{REF}}}.fsdp_config.{{use_torch_compile,{_FSDP_SPEED}}}": _COMPILE,
        f"critic.model.fsdp_config.{{use_torch_compile,ulysses_sequence_parallel_size,{_FSDP_SPEED}}}": _COMPILE,
        f"{{{A},{REF},critic.model}}.fsdp_config.offload_policy": _KERNEL,
        f"{REF}.fsdp_config.full_determinism": "a reference runs forward passes only: resources.deterministic "
        "(from the actor's) covers the trained models' updates",
        "reward_model.model.fsdp_config.{wrap_policy.*,forward_prefetch}": _KERNEL,
        f"{REF}.fsdp_config.{{optimizer_offload,ulysses_sequence_parallel_size}}": "a reference has no optimizer and "
        "follows the actor's sequence parallelism (actor_rollout_ref.ref.ulysses_sequence_parallel_size)",
        f"{M}.{{use_shm,use_liger,use_fused_kernels,fused_kernel_options.*,enable_activation_offload,tiled_mlp.*}}": _KERNEL,
        "critic.model.{use_shm,enable_activation_offload,tiled_mlp.*}": _KERNEL,
        "reward_model.model.{use_shm,use_fused_kernels,external_lib}": _KERNEL,
        "reward_model.model.input_tokenizer": "ppoflow writes the conversation again in the reward model's "
        "own tokenizer when it differs from the policy's, as veRL does with input_tokenizer",
        f"{M}.mtp.*": "read only with model.mtp.enable (refused)",
        f"{R}.mtp": "read only with model.mtp.enable (refused)",
        f"{{{A},{REF},critic}}.rollout_n": "veRL's copy of actor_rollout_ref.rollout.n",
        f"{{{A},critic}}.data_loader_seed": "ppoflow draws its mini-batch shuffles from the config's seeds",
        f"{{{A},critic}}.checkpoint.*": _CKPT,
        f"{{{A},critic}}.optim.total_training_steps": "veRL's trainer fills it in for the warmup ratio (refused)",
        f"{{{A},critic}}.optim.{{min_lr_ratio,num_cycles}}": _COSINE,
        f"{A}.{{tau_pos,tau_neg}}": "read only by the policy loss 'sapo', which ppoflow has not (refused)",
        f"{A}.policy_loss.{{clip_cov_ratio,clip_cov_lb,clip_cov_ub,kl_cov_ratio,ppo_kl_coef}}": "read only by "
        "the policy losses clip_cov and kl_cov, which ppoflow has not (refused)",
        f"{A}.calculate_entropy": "an entropy metric only (ppoflow reports actor/entropy)",
        f"{A}.freeze_vision_tower": _MM,
        f"{{{A},{REF}}}.router_replay.{{record_file,replay_file}}": "read only with router_replay (refused)",
        f"{R}.{{mode,free_cache_engine,multi_stage_wake_up,layered_summon,skip_tokenizer_init}}": _ENGINE,
        f"{R}.{{gpu_memory_utilization,enforce_eager,cudagraph_capture_sizes,max_num_batched_tokens}}": _ENGINE,
        f"{R}.{{max_model_len,max_num_seqs,enable_chunked_prefill,enable_prefix_caching,scheduling_policy}}": _ENGINE,
        f"{R}.load_format": "how veRL's engine first loads weights: ppoflow's engine starts from the model "
        "directory and takes pushed weights",
        f"{R}.engine_kwargs.*": _ENGINE,
        f"{R}.checkpoint_engine.*": "how veRL moves weights into its engines: ppoflow pushes them itself",
        f"{R}.{{disable_log_stats,skip_dump_dir,trace.*,prometheus.*}}": _OBSERVE,
        f"{R}.agent.{{num_workers,custom_async_server.name}}": _RAY,
        f"{R}.multi_turn.*": "read only with rollout.multi_turn.enable (refused)",
        f"{{{A},{REF},{R},critic,reward_model}}.profiler.*": _OBSERVE,
        "global_profiler.*": _OBSERVE,
        "trainer.{log_val_generations,rollout_data_dir,validation_data_dir}": _OBSERVE,
        "trainer.{balance_batch,esi_redundant_time,ray_wait_register_center_timeout,use_legacy_worker_impl}": _RAY,
        "trainer.del_local_ckpt_after_load": _CKPT,
        "actor_rollout_ref.nccl_timeout": _RAY,
        "ray_kwargs.*": _RAY,
        "transfer_queue.*": _RAY,
        "hydra.*": "Hydra's own settings (its output directory, logging)",
        "data.{use_shm,dataloader_num_workers,filter_overlong_prompts_workers,return_raw_input_ids}": _LOADER,
        "data.{return_raw_chat,return_full_prompt,trust_remote_code}": "veRL's dataloader plumbing "
        "(the tokenizer's trust_remote_code is actor_rollout_ref.model.trust_remote_code)",
        "data.{val_batch_size,validation_shuffle}": "ppoflow evaluates every held-out prompt in one pass",
        "data.{image_key,video_key,image_patch_size,return_multi_modal_inputs}": _MM,
        "data.{custom_cls.name,sampler.class_name,datagen.name}": "read only with its path (refused)",
        "reward_model.{enable_resource_pool,n_gpus_per_node,nnodes,num_workers,use_reward_loop}": _RAY,
        "reward_model.{reward_loop_source,reward_loop_class_name,launch_reward_fn_async}": _RAY,
        "reward_model.{ulysses_sequence_parallel_size,sandbox_fusion.max_concurrent}": _KERNEL,
        "reward_model.sandbox_fusion.memory_limit_mb": "read only with sandbox_fusion.url (refused)",
        "reward_model.rollout.*": "the engine of veRL's generative reward model: ppoflow's reward model scores",
        "reward_model.{overlong_buffer.log,reward_kwargs.overlong_buffer_cfg.log}": "ppoflow always reports "
        "response/overlong_penalty_mean",
        "reward_manager.module.name": "read only with reward_manager.module.path (refused)",
        "algorithm.pf_ppo.*": "read only with algorithm.use_pf_ppo (refused)",
    }
)

#: veRL settings whose value is a mapping of their own (not sections to descend into).
LEAVES = (
    *_expand(f"{{{M},critic.model,reward_model.model}}.override_config"),
    *_expand(f"{{{A},critic}}.optim.override_optimizer_config"),
    f"{R}.engine_kwargs",
    "data.apply_chat_template_kwargs",
)

#: veRL's defaults of the settings that change what is trained (and the run's name and length):
#: a command that does not give one of these gets veRL's value, not ppoflow's.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.train_batch_size": 1024,
    "data.truncation": "error",
    "data.shuffle": True,
    f"{M}.path": "~/models/deepseek-llm-7b-chat",
    f"{A}.ppo_mini_batch_size": 256,
    f"{A}.optim.lr": 1e-6,
    "critic.optim.lr": 1e-5,
    f"{A}.fsdp_config.model_dtype": "fp32",
    "algorithm.adv_estimator": "gae",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.use_kl_in_reward": False,
    f"{R}.n": 1,
    f"{R}.temperature": 1.0,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.total_epochs": 30,
    "trainer.val_before_train": True,
    "trainer.test_freq": -1,
    "trainer.save_freq": -1,
}


def matches(key: str, spec: str) -> bool:
    """Whether ``key`` is the catalogue entry ``spec`` (or below it, for ``prefix.*``)."""
    return key == spec or (spec.endswith(".*") and (key.startswith(spec[:-1]) or key == spec[:-2]))


def ignored_reason(key: str) -> str | None:
    """Why ``key`` has no meaning here, or None when it is not an ignored key."""
    if key.rsplit(".", 1)[-1] == "_target_":
        return "the class Hydra builds veRL's section into"
    for spec, reason in IGNORED.items():
        if matches(key, spec):
            return reason
    return None


def is_known(key: str) -> bool:
    """Whether ``key`` is a veRL key (mapped, checked or ignored)."""
    specs = (*MAPPED, *CHECKED)
    return any(matches(key, s) for s in specs) or ignored_reason(key) is not None


def nearest(key: str) -> str:
    """The veRL key closest to ``key``: one it is the end of (``actor.ppo_epochs`` ->
    ``actor_rollout_ref.actor.ppo_epochs``), else the closest by spelling, preferring one with the
    same last name (a ``prefix.*`` entry counts as its prefix)."""
    known = [s.removesuffix(".*") for s in (*MAPPED, *CHECKED, *IGNORED)]
    ending = [k for k in known if k.endswith("." + key)]
    if ending:
        return min(ending, key=len)
    tail = key.rsplit(".", 1)[-1]
    best = difflib.get_close_matches(key, known, n=1, cutoff=0.0)
    same_tail = [k for k in known if k.rsplit(".", 1)[-1] == tail]
    if same_tail and (not best or best[0].rsplit(".", 1)[-1] != tail):
        return difflib.get_close_matches(key, same_tail, n=1, cutoff=0.0)[0]
    return best[0]
