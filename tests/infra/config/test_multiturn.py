"""The ``rollout.multi_turn`` section: settings a multi-turn rollout cannot run with are refused
with the setting's name."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ppoflow.infra.config import RolloutConfig


def test_multi_turn_config_errors():
    with pytest.raises(ValidationError, match="tensor_model_parallel_size=1"):
        RolloutConfig(tensor_model_parallel_size=2, multi_turn={"enable": True})
    with pytest.raises(ValidationError, match="max_turn_tokens=64 exceeds the episode budget"):
        RolloutConfig(response_length=32, multi_turn={"enable": True, "max_turn_tokens": 64})
    with pytest.raises(ValidationError, match="max_turns"):
        RolloutConfig(multi_turn={"enable": True, "max_turns": 0})
