"""The demo at a test size: the same builders, config and flow as ``ppoflow demo``, with fewer
prompts, samples and warm-start steps (tests/conftest.py's ``demo`` fixture runs it)."""

from ppoflow.demo.experiment import DemoSpec
from ppoflow.demo.sft import SFTConfig

SMALL = DemoSpec(
    prompts=64,
    sft_examples=128,
    sft=SFTConfig(steps=4, batch_size=16, warmup_steps=1, log_every=2),
    overrides={
        "data.train_batch_size": 8,
        "rollout.n": 2,
        "rollout.max_num_seqs": 16,
        "rollout.kv_cache_gib": 0.02,
        "actor.ppo_mini_batch_size": 4,
        "critic.ppo_mini_batch_size": 4,
        "actor.ppo_micro_batch_size_per_gpu": 4,
        "critic.ppo_micro_batch_size_per_gpu": 4,
    },
)
