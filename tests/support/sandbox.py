"""What the ``python`` tool's sandbox may leave behind: its processes and its folders."""

from __future__ import annotations

import os
import tempfile

import psutil


def sandbox_processes() -> list[psutil.Process]:
    """Processes of this user whose working directory is a sandbox folder."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if "ppoflow-tool-" in proc.cwd():
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def sandbox_folders() -> list[str]:
    """Sandbox folders left in the temporary directory."""
    return [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("ppoflow-tool-")]
