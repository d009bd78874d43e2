"""Loading a user's class or function named ``package.module:name`` or ``path/to/file.py:name``."""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
from typing import Any

__all__ = ["load_object"]


@functools.lru_cache(maxsize=64)
def load_object(path: str, setting: str) -> Any:
    """The object ``path`` names; errors name ``setting`` (the config key) and the fix."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{setting}={path!r}: expected 'package.module:name' or 'path/to/file.py:name'")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise FileNotFoundError(
                f"{setting}={path!r}: file {module_name} does not exist (relative paths resolve "
                f"against {os.getcwd()})"
            )
        digest = hashlib.blake2b(os.path.abspath(module_name).encode(), digest_size=6).hexdigest()
        spec = importlib.util.spec_from_file_location(f"ppoflow_user_{digest}", module_name)
        assert spec is not None and spec.loader is not None  # a .py path always has a loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"{setting}={path!r}: cannot import {module_name!r} ({exc}); install the package or "
                "put its directory on PYTHONPATH"
            ) from exc
    if not hasattr(module, attr):
        raise AttributeError(f"{setting}={path!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)
