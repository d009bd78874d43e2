"""Every module of environment tests leaves nothing behind: no sandbox process, no sandbox folder."""

from __future__ import annotations

import pytest

from tests.support.sandbox import sandbox_folders, sandbox_processes


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind():
    yield
    assert sandbox_processes() == []
    assert not sandbox_folders()
