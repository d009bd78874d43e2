"""A worker group's methods as attributes: each calls the group by name; a name the worker
does not register fails at once, listing those it does."""

from __future__ import annotations

import pytest

from ppoflow.infra.remote.dispatch import Dispatch
from ppoflow.infra.remote.driver.handle import WorkerHandle


def test_a_handle_calls_registered_methods_and_names_the_others():
    calls = []
    methods = {"compute_values": Dispatch.DP_COMPUTE_PROTO, "init_model": Dispatch.ONE_TO_ALL}
    handle = WorkerHandle("critic", methods, lambda method, *a, **k: calls.append((method, a, k)) or "url")
    assert handle.compute_values("in.arrow", out_url="out.arrow") == "url"
    assert calls == [("compute_values", ("in.arrow",), {"out_url": "out.arrow"})]
    assert handle.mode("init_model") is Dispatch.ONE_TO_ALL
    assert {"compute_values", "init_model"} <= set(dir(handle))
    with pytest.raises(
        AttributeError,
        match="critic group's worker has no @register method 'compute_valeus'; it has compute_values, init_model",
    ):
        handle.compute_valeus("in.arrow")
    assert calls == [("compute_values", ("in.arrow",), {"out_url": "out.arrow"})]  # nothing called
