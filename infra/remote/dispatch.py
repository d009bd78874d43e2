"""Dispatch modes: how a driver-side ``WorkerGroup.call`` maps onto the ranks of a group.

A worker method is made callable from the driver by tagging it with ``@register(mode)``:

    class MyWorker(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def init_model(self) -> dict | None: ...

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: DataProto) -> DataProto | dict | None: ...

The tag is a plain attribute on the function (``__ppoflow_dispatch__``); nothing is wrapped, so a
registered method can still be called directly inside the rank. ``registered_methods(cls)`` lists
the tagged methods of a class (the rank entry sends this table to the driver, so the driver never
has to import the worker module), ``dispatch_mode_of(cls, name)`` looks one up.

A DP_COMPUTE_PROTO method whose output carries ``meta_info["metrics"]`` declares how they merge
over the dp shards: ``@register(Dispatch.DP_COMPUTE_PROTO, metrics=(MetricRule(...), ...))``
(:mod:`ppoflow.infra.remote.metric_merge`; ``metric_rules_of(cls, name)`` reads them back). Without
rules every metric is the mean over the shards.

The driver's side of DP_COMPUTE_PROTO (splitting the input, merging the outputs) is
:mod:`ppoflow.infra.remote.driver.dp_split`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ppoflow.infra.remote.metric_merge import MetricRule

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__ppoflow_dispatch__"
_RULES = "__ppoflow_metric_rules__"


class Dispatch(enum.Enum):
    """How one driver call is spread over the ranks and how the results come back.

    ONE_TO_ALL:       every rank gets the same JSON args; the driver returns a list of the per-rank
                      JSON results, in rank order.
    RANK_ZERO:        like ONE_TO_ALL (every rank runs the method, so collectives work), but the
                      driver returns only rank 0's result. For save / metrics style methods.
    DP_COMPUTE_PROTO: the driver splits a DataProto (given by URL) into ``dp_size`` chunks, the
                      rank(s) with ``dp_rank == i`` receive chunk ``i`` as a DataProto; DataProto
                      results of the output ranks are concatenated, unpadded and saved at
                      ``out_url``; JSON results come back as a list, one per rank.
    """

    ONE_TO_ALL = "ONE_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"


def register(dispatch_mode: Dispatch, *, metrics: Sequence[MetricRule] = ()) -> Callable[[F], F]:
    """Decorator: tag a worker method with its dispatch mode and, for DP_COMPUTE_PROTO, the rules
    by which its output's metrics merge over the dp shards (the function is returned unchanged)."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"register() takes a Dispatch member, got {dispatch_mode!r}")
    rules = tuple(metrics)
    if rules and dispatch_mode is not Dispatch.DP_COMPUTE_PROTO:
        raise TypeError(f"metrics= rules are for DP_COMPUTE_PROTO methods, not {dispatch_mode.value}")
    if not all(isinstance(r, MetricRule) for r in rules):
        raise TypeError(f"metrics= takes MetricRule objects, got {rules!r}")

    def deco(fn: F) -> F:
        setattr(fn, _ATTR, dispatch_mode)
        setattr(fn, _RULES, rules)
        return fn

    return deco


def registered_methods(cls: type) -> dict[str, Dispatch]:
    """All methods of ``cls`` (including inherited ones) tagged with ``@register``, by name."""
    out: dict[str, Dispatch] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        mode = getattr(getattr(cls, name, None), _ATTR, None)
        if isinstance(mode, Dispatch):
            out[name] = mode
    return out


def dispatch_mode_of(cls: type, method_name: str) -> Dispatch:
    """The dispatch mode of ``cls.method_name``; ``AttributeError`` if it is missing or unregistered."""
    fn = getattr(cls, method_name, None)
    if fn is None:
        known = ", ".join(sorted(registered_methods(cls))) or "none"
        raise AttributeError(
            f"{cls.__qualname__} has no method {method_name!r} (registered methods: {known})"
        )
    mode = getattr(fn, _ATTR, None)
    if not isinstance(mode, Dispatch):
        raise AttributeError(
            f"{cls.__qualname__}.{method_name} is not callable from the driver: decorate it with "
            f"@register(Dispatch.ONE_TO_ALL | Dispatch.RANK_ZERO | Dispatch.DP_COMPUTE_PROTO)"
        )
    return mode


def metric_rules_of(cls: type, method_name: str) -> tuple[MetricRule, ...]:
    """The metric merge rules ``cls.method_name`` was registered with (empty: the mean of each)."""
    return tuple(getattr(getattr(cls, method_name, None), _RULES, ()))
