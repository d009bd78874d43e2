"""torchrun scripts and helpers for tests/infra/checkpoint/test_checkpoints.py and tests/workers/test_reward_model_worker.py."""
