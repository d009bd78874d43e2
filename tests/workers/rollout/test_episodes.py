"""Episode metrics: what equal data-parallel shards report, merged by the rules the rollout
declares (``EPISODE_METRIC_RULES``), is what the whole batch reports."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ppoflow.infra.remote.metric_merge import merge_metrics
from ppoflow.workers.rollout.episodes import EPISODE_METRIC_RULES, Episode, episode_metrics

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
