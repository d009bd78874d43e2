"""The merge of a DP_COMPUTE_PROTO call's outputs: rows in dp_rank order, and the metrics of the
whole batch (not dp rank 0's), merged by the rules the ranks sent with their outputs."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.driver.dp_split import ProtoSplit, merge_results
from ppoflow.infra.remote.metric_merge import MetricRule
from ppoflow.infra.remote.protocol import Layout, Reply
from ppoflow.workers.rollout.episodes import EPISODE_METRIC_RULES


def _merged(tmp_path, shards, rules_of_rank=lambda rank: EPISODE_METRIC_RULES):
    replies, layout = [], []
    for rank, (cols, metrics) in reversed(list(enumerate(shards))):  # rank 0 holds dp rank 1
        url = str(tmp_path / f"out-{rank}.arrow")
        DataProto.from_dict({"turns": torch.tensor(cols["turns"])}, meta_info={"metrics": metrics}).save(url)
        replies.append(Reply(id=0, ok=True, kind="dataproto", result=url, metric_rules=rules_of_rank(rank)))
        layout.append(Layout(dp_rank=rank, dp_size=2))
    split = ProtoSplit(in_urls=["a", "b"], pad_size=0, padded_len=2, dp_size=2)
    return DataProto.load(
        merge_results("generate_sequences", replies, layout, split, str(tmp_path / "m.arrow"))
    )


def test_outputs_are_concatenated_in_dp_order_and_their_metrics_merged(tmp_path):
    """The rollout's declared rules (the worker's, which the driver does not know) give the batch's
    statistics."""
    # two shards of a multi-turn rollout: 2 episodes each, turns 1, 1 and 3, 2; only shard 1 used a tool
    shards = [
        ({"turns": [1, 1]}, {"rollout/turns_mean": 1.0, "rollout/turns_max": 1.0, "rollout/generate_s": 2.0}),
        (
            {"turns": [3, 2]},
            {
                "rollout/turns_mean": 2.5,
                "rollout/turns_max": 3.0,
                "rollout/generate_s": 4.0,
                "tool/python/calls_per_episode": 1.5,
                "tool/python/errors_per_episode": 0.5,
                "tool/python/error_rate": 1 / 3,
            },
        ),
    ]
    out = _merged(tmp_path, shards)

    turns = out.batch["turns"].tolist()
    assert turns == [1, 1, 3, 2]
    m = out.meta_info["metrics"]
    assert m["rollout/turns_mean"] == pytest.approx(sum(turns) / len(turns))  # the batch's mean
    assert m["rollout/turns_max"] == max(turns)
    assert m["rollout/generate_s"] == pytest.approx(3.0)  # per rank, on average
    assert m["tool/python/calls_per_episode"] == pytest.approx(3 / 4)  # 3 calls in 4 episodes
    assert m["tool/python/error_rate"] == pytest.approx(1 / 3)  # 1 of the 3 calls failed


def test_metrics_without_declared_rules_are_means_and_ranks_must_agree(tmp_path):
    shards = [
        ({"turns": [1]}, {"rollout/turns_max": 1.0, "x_per_episode": 2.0}),
        ({"turns": [3]}, {"rollout/turns_max": 3.0}),
    ]
    plain = _merged(tmp_path, shards, lambda rank: ()).meta_info["metrics"]
    assert plain == {"rollout/turns_max": 2.0, "x_per_episode": 2.0}  # no names known: the mean
    odd = (MetricRule(pattern="*", merge="max"),)
    with pytest.raises(ValueError, match="different metric rules"):
        _merged(tmp_path, shards, lambda rank: odd if rank else ())
