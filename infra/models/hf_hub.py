"""Model paths that name the Hugging Face hub, and whether the hub can be reached from here.

Where the hub cannot be reached (an offline cluster, a host without DNS) transformers finds out
slowly: ``huggingface_hub`` retries each file with back-off, so preflight's config and tokenizer
lookups of one uncached hub id would wait out every retry of every file before failing. One TCP
connection to the hub's endpoint answers the same question within :data:`CONNECT_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

__all__ = ["is_hub_id", "hub_unreachable", "cached_on_this_machine"]

CONNECT_TIMEOUT_S = 5.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def is_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path: what transformers looks up on the hub."""
    return not os.path.exists(path) and not path.startswith((".", "/", "~")) and path.count("/") == 1


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from this machine, or None when it can, when offline mode is
    on (``HF_HUB_OFFLINE``: transformers then reads its cache and asks nothing), or when a proxy is
    configured (the direct connection tried here says nothing about the proxy's)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return None
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        return f"{constants.ENDPOINT} cannot be reached from this machine ({exc})"
    return None


def cached_on_this_machine(repo_id: str) -> bool:
    """True when the hub id's ``config.json`` is in this machine's Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
