"""Keep Python's cyclic garbage collector off the long-lived heap while the engine decodes.

vLLM's decode loop is CPU-bound Python (a GPU decode step of a small model takes milliseconds), and
vLLM freezes the garbage collector's heap once, after building the engine (``gc.freeze()``), so
that collections during decoding only look at young objects. In a ppoflow rank much of the heap is
made after that: the FSDP modules' runtime state and, with ``model.use_torch_compile``, the
compiled graphs of the actor and reference (hundreds of thousands of objects). Every full
collection then walks all of it: vLLM's own ``sleep()`` runs one (``gc.collect()``) after each
rollout, several times longer once the graphs exist than before anything was compiled, and the
automatic ones fall inside ``generate``.

:func:`frozen_heap` collects what is garbage now (once the long-lived objects are frozen this only
walks the objects made since the last rollout), freezes every surviving object, and times the
collections inside the block. Objects frozen stay out of every later collection; reference counting
still frees them when they are dropped, only a cycle among them would stay, as with vLLM's own
freeze at start-up.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["GCTimer", "frozen_heap"]


class GCTimer:
    """A ``gc.callbacks`` entry adding up the seconds spent in collections and counting them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1
            self._start = None


@contextmanager
def frozen_heap() -> Iterator[GCTimer]:
    """Collect, freeze the survivors, then run the block; yields the timer of every collection from
    the one before the freeze to the block's end (``seconds``, ``collections``)."""
    timer = GCTimer()
    gc.callbacks.append(timer)
    try:
        gc.collect()
        gc.freeze()
        yield timer
    finally:
        gc.callbacks.remove(timer)
