"""Episodes as rollout rows (``assemble``: the columns ``ppoflow.workers.rollout.multiturn``
lists, written out by hand here), and their metrics: what equal data-parallel shards report,
merged by the rules the rollout declares (``EPISODE_METRIC_RULES``), is what the whole batch
reports. tests/workers/rollout/test_multiturn.py runs whole episodes on the engines."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.metric_merge import merge_metrics
from ppoflow.workers.rollout.base import SamplingSettings
from ppoflow.workers.rollout.episodes import EPISODE_METRIC_RULES, Episode, assemble, episode_metrics

# the metrics that describe the batch (timings and speeds are per rank, merged as their mean)
PER_RANK = (
    "rollout/generate_s",
    "rollout/sample_s",
    "rollout/env_s",
    "rollout/tokens_per_s",
    "rollout/policy_tokens_per_s",
)

_episode = st.builds(
    lambda turns, policy, env, ended, calls: (turns, policy, env, ended, calls),
    st.integers(1, 4),
    st.integers(1, 12),
    st.integers(0, 12),
    st.sampled_from(["done", "turn_limit", "budget"]),
    st.dictionaries(
        st.sampled_from(["python", "search"]), st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=2
    ),
)


def _episode_of(turns, policy, env, ended, calls) -> Episode:
    ep = Episode(env=None, schemas=[], prompt=[1], turns=turns, ended_by=ended)  # type: ignore[arg-type]
    ep.add([5] * policy, True)
    ep.add([6] * env, False)
    ep.tool_calls = {name: [c, min(e, c)] for name, (c, e) in calls.items()}
    return ep


@settings(max_examples=60, deadline=None)
@given(st.lists(_episode, min_size=2, max_size=12), st.sampled_from([1, 2, 3, 4]))
def test_merged_shards_are_the_whole_batch(raw, dp):
    assume(len(raw) >= dp)
    episodes = [_episode_of(*e) for e in raw[: len(raw) // dp * dp]]
    whole = episode_metrics(episodes, 1.0, 1.0, 0.0, 10)
    share = len(episodes) // dp
    shards = [episode_metrics(episodes[i * share : (i + 1) * share], 1.0, 1.0, 0.0, 10) for i in range(dp)]
    merged = merge_metrics(shards, EPISODE_METRIC_RULES)
    assert set(merged) == set(whole)
    for key, value in whole.items():
        if key not in PER_RANK:
            assert merged[key] == pytest.approx(value, abs=1e-12), key


def _played(prompt: list[int], turns: list[tuple[list[int], list[float], list[int]]], ended: str) -> Episode:
    """An episode of policy turns ``(tokens, log-probs, the environment's answer)``, as the
    rollout records them (the turn count first, then the turn's tokens, then the answer)."""
    ep = Episode(env=None, schemas=[], prompt=prompt, ended_by=ended)  # type: ignore[arg-type]
    for policy, lps, answer in turns:
        ep.turns += 1
        ep.add(policy, True, lps)
        if answer:
            ep.add(answer, False)
    return ep


def test_assemble_lays_episodes_out_as_rollout_rows():
    """Prompts left-padded as given, episodes right-padded, the loss mask on the policy's tokens
    only, turns, rewards at their positions; the input's position ids kept when the episodes'
    prompts are the input's, counted from the mask when the environment rendered others."""

    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[1, 5, 6], [7, 8, 9]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 3, 4], [3, 4, 5]]),  # not the mask's count: seen if kept
        },
        {"uid": ["a", "b"]},
        {"seed": 3},
    )
    s = SamplingSettings(n=2, temperature=1.0, top_p=1.0, top_k=-1, response_length=4, do_sample=True)
    episodes = [
        _played([5, 6], [([10, 11], [-0.5, -0.25], [12]), ([13], [-1.0], [])], "done"),
        _played([5, 6], [], "budget"),
        _played([7, 8, 9], [([20], [-2.0], [])], "done"),
        _played([7, 8, 9], [([21, 22], [-0.1, -0.2], [])], "turn_limit"),
    ]
    episodes[0].rewards = {3: 1.0}
    episodes[2].rewards = {0: 0.5}
    out = assemble(prompts, episodes, s, {"x": 2.0}, pad_token_id=1, log_probs=True)
    b = out.batch
    assert b["prompts"].tolist() == [[1, 5, 6], [1, 5, 6], [7, 8, 9], [7, 8, 9]]
    assert b["responses"].tolist() == [[10, 11, 12, 13], [1, 1, 1, 1], [20, 1, 1, 1], [21, 22, 1, 1]]
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert b["attention_mask"].tolist() == [
        [0, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
    ]
    assert b["response_mask"].tolist() == [[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert b["turn_ids"].tolist() == [[0, 0, 0, 1], [-1] * 4, [0, -1, -1, -1], [0, 0, -1, -1]]
    assert b["env_scores"].tolist() == [[0, 0, 0, 1.0], [0] * 4, [0.5, 0, 0, 0], [0] * 4]
    assert b["rollout_log_probs"].tolist() == [
        [-0.5, -0.25, 0.0, -1.0],
        [0.0] * 4,
        [-2.0, 0.0, 0.0, 0.0],
        pytest.approx([-0.1, -0.2, 0.0, 0.0]),
    ]
    assert b["position_ids"].tolist() == [[0, 3, 4, 5, 6, 7, 8]] * 2 + [[3, 4, 5, 6, 7, 8, 9]] * 2
    assert b["num_turns"].tolist() == [2, 0, 1, 1] and b["budget_ended"].tolist() == [0, 1, 0, 0]
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert out.meta_info["seed"] == 3 and out.meta_info["n"] == 2 and out.meta_info["metrics"] == {"x": 2.0}

    # the environment rendered the first prompt with more tokens: positions follow the new masks
    for ep in episodes[:2]:
        ep.prompt = [4, 5, 6]
    out = assemble(prompts, episodes, s, {}, pad_token_id=1, log_probs=False)
    assert out.batch["prompts"][0].tolist() == [4, 5, 6] and "rollout_log_probs" not in out.batch
    assert out.batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6]] * 4
