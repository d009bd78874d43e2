"""ppoflow.infra.queue.staleness: the versions of every token, their statistics and the bound,
against a plain loop over the tokens."""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.queue.staleness import (
    StalenessBoundBroken,
    admissible_batches,
    check_bound,
    staleness_metrics,
    tag_versions,
)


def _batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    versions = torch.tensor([[3, 3, 4, -1], [4, 4, -1, -1], [2, 3, 3, 4]], dtype=torch.int32)
    return versions, mask


def test_metrics_count_every_sampled_token_by_its_staleness():
    versions, mask = _batch()
    n = 5  # trains version 4
    tokens = [(n - 1) - int(v) for row, m in zip(versions, mask) for v, keep in zip(row, m) if keep]
    got = staleness_metrics(versions, mask, n, max_staleness=2)
    assert got["async/staleness_mean"] == pytest.approx(sum(tokens) / len(tokens))
    assert got["async/staleness_max"] == max(tokens)
    assert [got[f"async/tokens_staleness_{d}"] for d in range(3)] == [tokens.count(d) for d in range(3)]
    assert (got["async/version_min"], got["async/version_max"]) == (2, 4)
    assert got["async/mixed_version_sequences"] == 2  # rows 0 and 2 span a weight update


def test_tagging_marks_the_response_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert tag_versions(mask, 7).tolist() == [[7, 7, -1], [7, -1, -1]]
    assert staleness_metrics(tag_versions(mask, 7), mask, 8, 0)["async/staleness_max"] == 0


def test_the_bound_refuses_tokens_too_old_or_newer_than_the_trainer():
    versions, mask = _batch()
    check_bound(versions, mask, n=5, max_staleness=2)  # versions 2..4 for iteration 5: ok
    with pytest.raises(StalenessBoundBroken, match="versions 2..4.*only on versions 3..4"):
        check_bound(versions, mask, n=5, max_staleness=1)
    with pytest.raises(StalenessBoundBroken, match="only on versions 1..3"):
        check_bound(versions, mask, n=4, max_staleness=2)  # version 4 does not exist yet at 4
    check_bound(torch.zeros((2, 3), dtype=torch.int32), torch.ones((2, 3)), n=1, max_staleness=0)


@pytest.mark.parametrize("s", [0, 1, 2])
def test_a_producer_starts_a_batch_only_once_the_oldest_version_it_may_hold_is_published(s):
    assert list(admissible_batches(committed=0, latest=None, max_staleness=s)) == []
    for committed in range(4):
        for latest in range(committed, committed + 2):  # update n publishes before commit n
            batches = list(admissible_batches(committed, latest, s))
            assert batches == [n for n in range(committed + 1, 20) if n - 1 - s <= latest]
            # a batch no update consumed yet (n > latest) sampled from `latest` on is in the bound
            for n in (n for n in batches if n > latest):
                check_bound(torch.full((1, 1), latest, dtype=torch.int32), torch.ones((1, 1)), n, s)
    assert list(admissible_batches(3, 5, 2, until=6)) == [4, 5, 6]
