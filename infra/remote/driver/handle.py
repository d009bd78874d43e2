"""``WorkerHandle``: the driver's view of one worker group's methods.

The ranks send their worker class's ``@register`` table when the group starts
(:class:`~ppoflow.infra.remote.protocol.Ready`), so the driver checks a method's name and knows
its dispatch mode without importing the worker's module (and the FSDP, vLLM and transformers
code behind it):

    handle = WorkerHandle("critic", group.methods, lambda method, *a, **k: group.call(method, *a, **k))
    handle.compute_values(rollout_url, out_url=values_url)     # -> values_url
    handle.compute_valeus(...)                                 # AttributeError naming the methods there are

With the group's contract (:mod:`ppoflow.infra.remote.contracts`) every call's arguments are bound
to the contract's signature first: a keyword the worker does not take fails here, with the group
intact, not in the ranks. :func:`typed_handle` makes such a handle, typed as the contract's
Protocol (``WorkerGroup.typed``, ``RunGroups.worker``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ppoflow.infra.remote.contracts import Role
from ppoflow.infra.remote.dispatch import Dispatch

__all__ = ["WorkerHandle", "typed_handle"]

C = TypeVar("C")


class WorkerHandle:
    """An attribute per registered method of a group's worker class; calling one calls ``call(method,
    *args, **kwargs)``. DP_COMPUTE_PROTO methods take the input DataProto's URL and return the
    output's URL (or the per-rank JSON results); ONE_TO_ALL methods return the per-rank results;
    RANK_ZERO rank 0's. ``contract``: the Protocol whose signatures the calls' arguments must fit."""

    def __init__(
        self,
        name: str,
        methods: dict[str, Dispatch],
        call: Callable[..., Any],
        contract: type | None = None,
    ):
        self._name, self._methods, self._call = name, dict(methods), call
        self._contract = contract

    def __getattr__(self, method: str) -> Callable[..., Any]:
        methods = self.__dict__.get("_methods", {})
        if method not in methods:
            raise AttributeError(
                f"the {self.__dict__.get('_name')} group's worker has no @register method {method!r}; "
                f"it has {', '.join(sorted(methods))}"
            )
        contract = self.__dict__.get("_contract")
        if contract is None:
            return functools.partial(self._call, method)
        return functools.partial(self._checked, _signature(contract, method), method)

    def _checked(self, signature: inspect.Signature, method: str, *args: Any, **kwargs: Any) -> Any:
        """``call(method, ...)`` once the arguments fit the contract's ``signature``."""
        try:
            signature.bind(self, *args, **kwargs)
        except TypeError as exc:
            shown = signature.replace(
                parameters=list(signature.parameters.values())[1:], return_annotation=signature.empty
            )
            raise TypeError(f"{self._name}.{method}{shown}: {exc} (nothing was sent to the ranks)") from None
        return self._call(method, *args, **kwargs)

    def mode(self, method: str) -> Dispatch:
        """The dispatch mode of ``method``."""
        return self._methods[method]

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._methods))


@functools.cache
def _signature(contract: type, method: str) -> inspect.Signature:
    fn = getattr(contract, method, None)
    if fn is None:
        raise AttributeError(f"{contract.__name__} has no method {method!r}: the contract does not call it")
    return inspect.signature(fn)


def typed_handle(role: Role[C], methods: dict[str, Dispatch], call: Callable[..., Any]) -> C:
    """A handle of ``role``'s group, typed as its Protocol: ``call(method, *args, **kwargs)``
    calls the group. TypeError when ``methods`` (the table the ranks sent) differs from the
    contract's."""
    problem = role.mismatch(methods)
    if problem is not None:
        raise TypeError(
            f"the {role.name} group's worker ({role.worker}) does not keep its contract "
            f"({role.protocol.__name__}): {problem}"
        )
    return cast(C, WorkerHandle(role.name, methods, call, role.protocol))
