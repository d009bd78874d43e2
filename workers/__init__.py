"""ppoflow.workers: the code that runs inside the ranks (never imported by the flow's process).

Worker classes (called by the driver through ``ppoflow.infra.remote``):
actor_rollout_ref_worker.py  the policy side: rollout, old and reference log-probs, actor update
critic_worker.py             the value model: values, critic update
reward_model_worker.py       a sequence-classification reward model's scores
worker_setup.py              the config and role every worker class starts from
checkpointing.py             the checkpoint methods the actor's and the critic's workers share
teacher.py                   the frozen teacher of on-policy distillation on the actor's ranks

The models they run and train:
actor.py, critic.py          log-probs / values and the PPO updates of FSDP-sharded models
minibatch.py                 mini- and micro-batches of an update, shared by actor and critic
optim.py                     the optimizer, its LR schedule and the clipped step
modeling.py                  FSDP root modules around Hugging Face models
hf_models.py                 loading or building the Hugging Face models
lm_head.py                   per-token log-probs from hidden states, a chunk of tokens at a time
fsdp_utils.py                the device mesh and the FSDP2 sharding
packing.py                   padding-free forwards of packed micro-batches
attention.py                 their attention: inside each sequence, with sliding windows and sinks
sequence_parallel.py         Ulysses sequence parallelism: a packed micro-batch split across ranks
compiled.py                  ``torch.compile`` of the trained models
lora.py                      LoRA adapters (PEFT) on the FSDP models
moe.py                       a mixture-of-experts policy's router metrics (load balance)
determinism.py               deterministic kernels for the updates
device_memory.py             a rank's GPU memory: peaks, the engine's pool, releasing spare blocks

rollout/                     rollout engines (vLLM, HF), multi-turn episodes, the weight sync
"""
