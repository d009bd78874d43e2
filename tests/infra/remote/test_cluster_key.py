"""The shared secret of a multi-node run: read from a private file or the environment, and every problem named with its fix."""

from __future__ import annotations

import os

import pytest

from ppoflow.infra.config import ConfigError
from ppoflow.infra.remote.cluster_key import ClusterKeyError, load_cluster_key

KEY = "k" * 40


# ---------------------------------------------------------------------- the key
def test_cluster_key_from_a_private_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text(KEY + "\n")
    os.chmod(path, 0o600)
    assert load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(path)}) == KEY.encode()
    assert load_cluster_key({"PPOFLOW_CLUSTER_KEY": f" {KEY} "}) == KEY.encode()


def test_cluster_key_problems_name_the_fix(tmp_path):
    with pytest.raises(ClusterKeyError, match="neither PPOFLOW_CLUSTER_KEY_FILE nor PPOFLOW_CLUSTER_KEY"):
        load_cluster_key({})
    path = tmp_path / "key"
    path.write_text(KEY)
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match=f"chmod 600 {path}"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(path)})
    with pytest.raises(ClusterKeyError, match="at least 16"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY": "short"})
    with pytest.raises(ClusterKeyError, match="cannot read"):
        load_cluster_key({"PPOFLOW_CLUSTER_KEY_FILE": str(tmp_path / "missing")})
    assert isinstance(ClusterKeyError("x"), ConfigError)  # a permanent error: Prefect does not retry it
