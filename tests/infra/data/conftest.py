"""The storage kinds every codec and storage test runs on."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["plain", "relative", "file", "memory", "s3"])
def base_url(request, tmp_path, monkeypatch):
    """A fresh directory URL of each kind."""
    kind = request.param
    if kind == "plain":
        return str(tmp_path)
    if kind == "relative":
        monkeypatch.chdir(tmp_path)
        return "rel/dir"
    if kind == "file":
        return "file://" + str(tmp_path)
    if kind == "memory":
        return f"memory://ppoflow-tests/{uuid.uuid4().hex}"
    server = request.getfixturevalue("s3_server")
    return f"{server['url']}/{uuid.uuid4().hex}"
