"""``WorkerHandle``: the driver's view of one worker group's methods.

The ranks send their worker class's ``@register`` table when the group starts
(:class:`~ppoflow.infra.remote.protocol.Ready`), so the driver checks a method's name and knows
its dispatch mode without importing the worker's module (and the FSDP, vLLM and transformers
code behind it):

    handle = WorkerHandle("critic", group.methods, lambda method, *a, **k: group.call(method, *a, **k))
    handle.compute_values(rollout_url, out_url=values_url)     # -> values_url
    handle.compute_valeus(...)                                 # AttributeError naming the methods there are
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ppoflow.infra.remote.dispatch import Dispatch

__all__ = ["WorkerHandle"]


class WorkerHandle:
    """An attribute per registered method of a group's worker class; calling one calls ``call(method,
    *args, **kwargs)``. DP_COMPUTE_PROTO methods take the input DataProto's URL and return the
    output's URL (or the per-rank JSON results); ONE_TO_ALL methods return the per-rank results;
    RANK_ZERO rank 0's."""

    def __init__(self, name: str, methods: dict[str, Dispatch], call: Callable[..., Any]):
        self._name, self._methods, self._call = name, dict(methods), call

    def __getattr__(self, method: str) -> Callable[..., Any]:
        methods = self.__dict__.get("_methods", {})
        if method not in methods:
            raise AttributeError(
                f"the {self.__dict__.get('_name')} group's worker has no @register method {method!r}; "
                f"it has {', '.join(sorted(methods))}"
            )
        return functools.partial(self._call, method)

    def mode(self, method: str) -> Dispatch:
        """The dispatch mode of ``method``."""
        return self._methods[method]

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))
