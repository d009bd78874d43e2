"""Named IPC resources of vLLM's CPU tensor parallelism, without ranks: stale shm-allreduce segments
are removed and fresh ones kept; a message queue's writer-side names (its shm ring buffer, its IPC
sockets) are unlinked while the mappings made before stay valid and nothing is unlinked twice."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from ppoflow.workers.rollout.vllm_ipc import _unlink_ipc, _unlink_shared_memory, remove_stale_segments

DAY = 86_400.0


def test_stale_segments_are_removed_and_fresh_ones_kept():
    tag = uuid.uuid4().hex[:8]
    old, fresh = (f"/dev/shm/-tp:0-[0-1]-ppoflow{tag}{k}-cpushm_0" for k in ("old", "fresh"))
    for path in (old, fresh):
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
    past = time.time() - 30 * DAY  # older than any segment of a group running now
    os.utime(old, (past, past))
    try:
        removed = remove_stale_segments(max_age_s=29 * DAY)
        assert os.path.basename(old) in removed and os.path.basename(fresh) not in removed
        assert not os.path.exists(old) and os.path.exists(fresh)
    finally:
        for path in (old, fresh):
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.slow  # imports vLLM (~15 s on a busy machine)
def test_a_writer_s_names_go_and_its_mappings_stay():
    from multiprocessing import resource_tracker, shared_memory

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    queue = MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2)  # a writer with one local reader
    name = queue.buffer.shared_memory.name
    sockets = [queue.handle.local_subscribe_addr, queue.handle.local_notify_addr]
    reader = shared_memory.SharedMemory(name=name)  # mapped by a reader before the names go
    resource_tracker.unregister(reader._name, "shared_memory")  # the writer owns the segment
    try:
        assert os.path.exists(f"/dev/shm/{name.lstrip('/')}")
        assert all(a.startswith("ipc://") and os.path.exists(a[len("ipc://") :]) for a in sockets)
        _unlink_shared_memory(queue.buffer)
        for addr in sockets:
            _unlink_ipc(addr)
        assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")
        assert not any(os.path.exists(a[len("ipc://") :]) for a in sockets)
        queue.buffer.shared_memory.buf[0] = 42  # the writer's mapping still works
        assert reader.buf[0] == 42  # and the reader's still sees it
        assert queue.buffer.is_creator is False  # its __del__ will not unlink again
        _unlink_shared_memory(queue.buffer)  # nor will a second release
    finally:
        reader.close()
