"""Dispatch modes and the @register table of a worker class: what the ranks send the driver
(each method's mode, and a DP_COMPUTE_PROTO method's metric merge rules)."""

from __future__ import annotations

import pytest

from ppoflow.infra.remote.dispatch import (
    Dispatch,
    dispatch_mode_of,
    metric_rules_of,
    register,
    registered_methods,
)
from ppoflow.infra.remote.metric_merge import MetricRule
from ppoflow.infra.remote.protocol import Reply, decode, encode
from tests.support.toy_workers import ToyWorker

RATIO = MetricRule(pattern="*/rate", merge="ratio", of=("hits", "tries"))


def test_dispatch_registry():
    assert dispatch_mode_of(ToyWorker, "info") is Dispatch.ONE_TO_ALL
    assert dispatch_mode_of(ToyWorker, "double") is Dispatch.DP_COMPUTE_PROTO
    assert registered_methods(ToyWorker)["stats"] is Dispatch.DP_COMPUTE_PROTO
    assert "shutdown" not in registered_methods(ToyWorker)  # a hook, not callable from the driver
    with pytest.raises(AttributeError, match="not callable from the driver"):
        dispatch_mode_of(ToyWorker, "not_registered")
    with pytest.raises(AttributeError, match="no method 'nope'"):
        dispatch_mode_of(ToyWorker, "nope")
    with pytest.raises(TypeError):
        register("ONE_TO_ALL")  # type: ignore[arg-type]


def test_metric_rules_are_declared_with_the_method_and_travel_in_the_reply():
    class W:
        @register(Dispatch.DP_COMPUTE_PROTO, metrics=(RATIO,))
        def ratios(self, data): ...

        @register(Dispatch.DP_COMPUTE_PROTO)
        def plain(self, data): ...

    assert metric_rules_of(W, "ratios") == (RATIO,) and metric_rules_of(W, "plain") == ()
    reply = Reply(id=1, ok=True, kind="dataproto", result="u", metric_rules=metric_rules_of(W, "ratios"))
    assert decode(encode(reply), Reply).metric_rules == (RATIO,)
    with pytest.raises(TypeError, match="DP_COMPUTE_PROTO"):
        register(Dispatch.ONE_TO_ALL, metrics=(RATIO,))
    with pytest.raises(TypeError, match="MetricRule"):
        register(Dispatch.DP_COMPUTE_PROTO, metrics=({"pattern": "*", "merge": "max"},))  # type: ignore[arg-type]
