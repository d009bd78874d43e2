"""Hub ids among model paths, whether the hub's endpoint answers (one TCP connection, not
huggingface_hub's minute of retries), and whether an id is in this machine's cache."""

from __future__ import annotations

import socket

import pytest
from huggingface_hub import constants

from ppoflow.infra.models.hf_hub import cached_on_this_machine, hub_unreachable, is_hub_id

_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def test_hub_ids_are_org_slash_name_that_is_not_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "local").mkdir()
    assert is_hub_id("Qwen/Qwen2.5-0.5B") and not is_hub_id("org/local")
    for path in ("/models/x", "./a/b", "~/a", "a/b/c", "name"):
        assert not is_hub_id(path), path


@pytest.fixture
def endpoint(monkeypatch):
    for var in _PROXIES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def at(port: int) -> str:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
        return constants.ENDPOINT

    return at


def test_an_endpoint_that_refuses_is_named_and_one_that_listens_is_not(endpoint, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        endpoint(server.getsockname()[1])
        assert hub_unreachable() is None
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        url = endpoint(closed.getsockname()[1])
    assert hub_unreachable().startswith(f"{url} cannot be reached from this machine (")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # the proxy's reach is unknown: no claim
    assert hub_unreachable() is None


def test_a_cached_config_counts_as_on_this_machine(tmp_path, monkeypatch):
    snapshot = tmp_path / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert cached_on_this_machine("org/cached") and not cached_on_this_machine("org/missing")
