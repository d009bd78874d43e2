"""The collector kept off the long-lived heap while the engine decodes (``gc_heap``)."""

from __future__ import annotations


def test_frozen_heap_collects_cycles_then_keeps_the_survivors_out_of_collections():
    """What VLLMRollout holds around generate: garbage cycles freed first, the objects alive then
    moved out of the collector's generations (later collections do not walk them), collections timed."""
    import gc
    import weakref

    from ppoflow.workers.rollout.gc_heap import frozen_heap

    class Node:
        pass

    dropped = Node()
    dropped.me = dropped  # a cycle: only the cyclic collector frees it
    dead = weakref.ref(dropped)
    del dropped
    kept = Node()
    kept.me = kept
    frozen_before = gc.get_freeze_count()
    try:
        with frozen_heap() as timer:
            assert dead() is None, "the cycle made before the rollout was not collected"
            assert gc.get_freeze_count() > frozen_before
            assert all(o is not kept for o in gc.get_objects()), "a survivor is still in a generation"
            gc.collect()
        assert timer.collections >= 2 and timer.seconds > 0.0
        assert kept.me is kept
    finally:
        gc.unfreeze()
