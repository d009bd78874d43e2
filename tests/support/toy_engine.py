"""A toy rollout engine for the engine-registry tests: registered as ``rollout.engine: toy`` by
:func:`register_toy` (the one place it is declared, as a real engine's spec is).

``ToyRollout`` samples nothing: every response (and every multi-turn turn) is the context's last
token repeated to the length limit, with the engine's own log-prob 0.0 for each (it is certain).
That is an independent reference a test can write down. Its capabilities are multi_turn and
always_log_probs; it has no weights of its own (the no-op sharding manager).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ppoflow.infra.models.rollout_engines import EngineSpec, register_engine
from ppoflow.workers.rollout.base import (
    EngineSite,
    Rollout,
    SamplingSettings,
    TurnSamples,
    assemble_output,
    check_prompts,
    prompt_token_lists,
)

TOY = EngineSpec(
    name="toy",
    engine="tests.support.toy_engine:ToyRollout",
    sharding_manager="ppoflow.workers.rollout.sharding_manager:NoOpShardingManager",
    capabilities=frozenset({"multi_turn", "always_log_probs"}),
)


def register_toy(monkeypatch, **changes: Any) -> EngineSpec:
    """Register ``TOY`` (with ``changes``, e.g. ``capabilities=...``) for one test: the registry is
    restored when the test ends."""
    from ppoflow.infra.models import rollout_engines

    monkeypatch.setattr(rollout_engines, "_ENGINES", dict(rollout_engines._ENGINES))
    return register_engine(dataclasses.replace(TOY, **changes))


class ToyRollout(Rollout):
    """See the module docstring."""

    def __init__(self, config: Any, site: EngineSite):
        self.config, self.pad_token_id = config, site.pad_token_id
        self.turns: list[int] = []  # how many contexts each sample_turn call got

    @classmethod
    def from_config(cls, config: Any, site: EngineSite, **engine_kwargs: Any) -> ToyRollout:
        return cls(config.rollout, site)

    def generate_sequences(self, prompts):
        s = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_prompts(prompts)
        rows = prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        responses = [[row[-1]] * s.response_length for row in rows for _ in range(s.n)]
        log_probs = [[0.0] * len(r) for r in responses]
        return assemble_output(
            prompts, responses, log_probs, s, self.pad_token_id, {"rollout/generate_s": 0.0}
        )

    def sample_turn(
        self,
        contexts: list[list[int]],
        limits: list[int],
        episode_ids: list[int],
        turn: int,
        settings: SamplingSettings,
        meta_seed: Any,
        call: int,
    ) -> TurnSamples:
        self.turns.append(len(contexts))
        return [([c[-1]] * m, [0.0] * m) for c, m in zip(contexts, limits)]
