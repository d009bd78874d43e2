"""User objects a config names by import path (``package.module:name`` or ``path/to/file.py:name``):
``reward.custom_function``, ``rollout.multi_turn.environment`` and ``tools``, the rollout queue's
admission policy. One loader for all of them, below the packages that use it (rewards, envs,
queue), so each error names the setting and the fix the same way.

loader.py  load_object: a spec resolved to its object (a file imported once per process); the
           modules of ppoflow 0.1 that saved configs may still name
"""

from ppoflow.infra.plugins.loader import MOVED_MODULES, load_object

__all__ = ["load_object", "MOVED_MODULES"]
