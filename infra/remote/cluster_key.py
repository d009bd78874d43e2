"""The shared secret of a multi-node run: what lets agents, ranks and the driver trust each other.

Every connection to a driver's control endpoint (an agent's, a rank's) passes the HMAC challenge
of ``multiprocessing.connection`` in both directions with this key, so a peer without it can
neither send commands to a node nor pose as a rank. The key is never on a command line, in the
experiment config, in storage or in a log line; each process reads it from its environment:

    PPOFLOW_CLUSTER_KEY_FILE   a file holding the key (mode 0600: refused if group/others can read it)
    PPOFLOW_CLUSTER_KEY        the key itself (e.g. from a Kubernetes Secret via secretKeyRef)

Make one with ``openssl rand -hex 32 > ~/.ppoflow-cluster-key && chmod 600 ~/.ppoflow-cluster-key``.
The driver and every agent must hold the same key; the agents hand it to their ranks in the
environment (readable only by the same user), never on the command line.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from ppoflow.infra.config import ConfigError

__all__ = ["ENV_KEY", "ENV_KEY_FILE", "MIN_KEY_CHARS", "ClusterKeyError", "load_cluster_key"]

ENV_KEY = "PPOFLOW_CLUSTER_KEY"
ENV_KEY_FILE = "PPOFLOW_CLUSTER_KEY_FILE"
MIN_KEY_CHARS = 16
_HOW = "make one with `openssl rand -hex 32 > KEYFILE && chmod 600 KEYFILE` and set PPOFLOW_CLUSTER_KEY_FILE=KEYFILE"


class ClusterKeyError(ConfigError):
    """No usable cluster key in this process's environment; the message says how to provide one
    (a ``ConfigError``: retrying cannot fix it)."""


def load_cluster_key(env: Mapping[str, str] | None = None, who: str = "this process") -> bytes:
    """The cluster key from ``PPOFLOW_CLUSTER_KEY_FILE`` or ``PPOFLOW_CLUSTER_KEY`` (stripped, UTF-8).

    Raises ``ClusterKeyError`` naming the problem and the fix: no key, an unreadable or too
    widely readable key file, a key shorter than :data:`MIN_KEY_CHARS` characters.
    """
    env = os.environ if env is None else env
    path, value = env.get(ENV_KEY_FILE), env.get(ENV_KEY)
    if path:
        try:
            mode = os.stat(path).st_mode
            with open(path, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError as err:
            raise ClusterKeyError(f"{ENV_KEY_FILE}={path}: cannot read the cluster key ({err})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterKeyError(
                f"{ENV_KEY_FILE}={path} is readable by other users (mode {stat.filemode(mode)}); "
                f"run `chmod 600 {path}`"
            )
        source = ENV_KEY_FILE
    elif value:
        text, source = value.strip(), ENV_KEY
    else:
        raise ClusterKeyError(
            f"{who} needs the run's cluster key (the shared secret of the driver and the agents) "
            f"and found neither {ENV_KEY_FILE} nor {ENV_KEY} in its environment: {_HOW}, on the "
            "driver and on every node"
        )
    if len(text) < MIN_KEY_CHARS:
        raise ClusterKeyError(
            f"the cluster key from {source} has {len(text)} characters; use at least "
            f"{MIN_KEY_CHARS} random ones ({_HOW})"
        )
    return text.encode("utf-8")
