"""torchrun scripts and helpers for tests/test_checkpoint.py and tests/test_rewards.py."""
