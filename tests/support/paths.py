"""Where things are: the repository root (tests run scripts and subprocesses from it)."""

from __future__ import annotations

import os

#: The repository root (the folder holding ``tests/``).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
