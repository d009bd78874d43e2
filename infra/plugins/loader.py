"""The one loader of the objects a config names by import path.

    load_object("my_pkg.rewards:score", "reward.custom_function", what="function")
    load_object("envs/guess.py:GuessEnv", "rollout.multi_turn.environment", what="Class")

A spec is ``package.module:name`` (imported like any module, so the package must be importable
in the process that loads it: the flow's for rewards, the ranks' for environments and tools) or
``path/to/file.py:name`` (a relative path resolves against the working directory). Every error
names the config setting, what is wrong and the fix, and is one of the built-in types a caller
would expect: ``ValueError`` for a spec that is not one, ``FileNotFoundError``, ``ImportError``
(the module is missing, or importing it raised), ``AttributeError`` (the module has no such name).
Callers check what the object must be (a function, an ``Environment`` subclass, a tool).

A file is imported once per process however many settings name it (one module object, so the
environment class and the tool of one file see the same module state), and is registered in
``sys.modules`` as ``ppoflow_user_<hash of its path>``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["load_object", "MOVED_MODULES"]

_LOG = logging.getLogger("ppoflow.rewards")

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")

#: Modules of ppoflow 0.1 (top-level ``infra``, ``workers``, ...) that configs saved then may name,
#: and where they live now. Loading one still works, with a deprecation warning.
MOVED_MODULES = {
    "infra.demo_task": "ppoflow.demo.task",
    "infra.rewards": "ppoflow.infra.rewards",
}


def _forms(what: str) -> str:
    return f"write it as 'package.module:{what}' or 'path/to/file.py:{what}'"


def _split(spec: Any, setting: str, what: str) -> tuple[str, str]:
    """``(module or file, name)`` of a spec, or the ``ValueError`` that says what is malformed."""
    where = f"{setting}={spec!r}"
    if not isinstance(spec, str):
        raise ValueError(f"{where}: expected a string; {_forms(what)}")
    if spec != spec.strip():
        raise ValueError(f"{where}: spaces around the spec; {_forms(what)} without them")
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ValueError(
            f"{where}: the module or the {what} is missing (a ':' separates them); {_forms(what)}"
        )
    if not name.isidentifier():
        raise ValueError(f"{where}: {name!r} (after the last ':') is not a Python name; {_forms(what)}")
    if not module.endswith(".py") and not _MODULE_NAME.fullmatch(module):
        raise ValueError(
            f"{where}: {module!r} is neither a dotted module name (Python identifiers: no '-', '/' or "
            f"spaces) nor a path ending in '.py'; {_forms(what)}"
        )
    return module, name


@functools.lru_cache(maxsize=64)
def _file_module(path: str) -> ModuleType:
    """The module of the file at absolute ``path``, executed once per process."""
    digest = hashlib.blake2b(path.encode(), digest_size=6).hexdigest()
    name = f"ppoflow_user_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, pickle and typing look classes' modules up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _moved(spec: str, setting: str, module: str) -> ModuleType:
    """A ppoflow 0.1 module path: its new module, with a deprecation warning."""
    new = MOVED_MODULES[module]
    new_spec = f"{new}:{spec.rpartition(':')[2]}"
    warnings.warn(
        f"{setting}={spec!r} names a module of ppoflow 0.1; it is {new!r} now: write {new_spec!r} "
        "in the config",
        DeprecationWarning,
        stacklevel=4,
    )
    _LOG.warning(
        "%s=%r is deprecated (ppoflow 0.1 module path); loading %r instead: write it in the config",
        setting,
        spec,
        new_spec,
    )
    return importlib.import_module(new)


def _import(spec: str, setting: str, module: str) -> ModuleType:
    """The module of a spec: its file or its dotted name, every failure named with ``setting``."""
    where = f"{setting}={spec!r}"
    is_file = module.endswith(".py")
    if is_file and not os.path.isfile(module):
        raise FileNotFoundError(
            f"{where}: file {module} does not exist (relative paths resolve against "
            f"{os.getcwd()}); check the path"
        )
    try:
        return _file_module(os.path.abspath(module)) if is_file else importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module == missing or module.startswith(missing + "."):
            if module in MOVED_MODULES:
                return _moved(spec, setting, module)
            raise ImportError(
                f"{where}: cannot import module {module!r} ({exc}); install the package or put its "
                "directory on PYTHONPATH"
            ) from exc
        raise ImportError(
            f"{where}: module {module!r} imports {missing!r}, which is not installed here; install it "
            "where the run imports this module"
        ) from exc
    except Exception as exc:  # the user's module failed as it ran: name it
        raise ImportError(
            f"{where}: importing {module!r} raised {type(exc).__name__}: {exc}; fix the module"
        ) from exc


@functools.lru_cache(maxsize=64)
def load_object(spec: str, setting: str, what: str = "name") -> Any:
    """The object ``spec`` names (see the module docstring). ``setting`` is the config key the
    errors name; ``what`` the kind of object they ask for (``"function"``, ``"Class"``, ...)."""
    module_name, name = _split(spec, setting, what)
    module = _import(spec, setting, module_name)
    if not hasattr(module, name):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise AttributeError(
            f"{setting}={spec!r}: module {module_name!r} has no {name!r} (callables there: "
            f"{', '.join(public[:20]) or 'none'}); name one of them or define {name!r} there"
        )
    return getattr(module, name)
