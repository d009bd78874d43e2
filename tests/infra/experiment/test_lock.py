"""ppoflow.infra.experiment.lock: one run per experiment; takeover from a dead or silent owner; conditional writes on S3."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.lock import ExperimentLock, ExperimentLocked
from tests.support.paths import ROOT
from tests.support.s3_server import unpreempted_requests


def test_lock_refuses_a_live_owner_and_releases(tmp_path):
    url = str(tmp_path / "exp" / "lock.json")
    with ExperimentLock(url, "run-a", heartbeat_s=0.05):
        with pytest.raises(ExperimentLocked, match="run-a") as err:
            ExperimentLock(url, "run-b").acquire()
        assert "prefect flow-run cancel run-a" in str(err.value)
        time.sleep(0.2)  # heartbeats keep it
        assert json.loads(open(url).read())["run_id"] == "run-a"
    assert not os.path.exists(url)
    with ExperimentLock(url, "run-b"):
        pass


def test_lock_taken_over_from_a_dead_pid_and_a_stale_heartbeat(tmp_path):
    url = str(tmp_path / "lock.json")
    code = (
        "import os, sys; from ppoflow.infra.experiment.lock import ExperimentLock; "
        "ExperimentLock(sys.argv[1], 'dead-run').acquire(); os._exit(0)"
    )  # dies holding it
    subprocess.run([sys.executable, "-c", code, url], check=True, cwd=ROOT)
    assert json.loads(open(url).read())["run_id"] == "dead-run"
    logs = []
    lock = ExperimentLock(url, "run-b", log=logs.append).acquire()
    assert "is gone" in logs[0]
    lock.release()
    # an owner on another host with an old heartbeat is stale; with a fresh one it is not
    other = {
        "run_id": "far",
        "host": socket.gethostname() + "-x",
        "pid": 1,
        "token": "t",
        "heartbeat_at": time.time(),
    }
    storage.write_json_atomic(url, other)
    with pytest.raises(ExperimentLocked):
        ExperimentLock(url, "run-c", stale_after_s=60).acquire()
    storage.write_json_atomic(url, {**other, "heartbeat_at": time.time() - 120})
    ExperimentLock(url, "run-c", stale_after_s=60).acquire().release()


def test_lock_lost_is_detected(tmp_path):
    url = str(tmp_path / "lock.json")
    lock = ExperimentLock(url, "run-a", heartbeat_s=3600).acquire()
    lock.check()
    storage.write_json_atomic(url, {"run_id": "thief", "token": "other", "heartbeat_at": time.time()})
    lock.heartbeat()
    with pytest.raises(ExperimentLocked, match="no longer holds"):
        lock.check()
    lock.release()
    assert json.loads(open(url).read())["run_id"] == "thief"  # not ours: left alone


def test_lock_on_s3_is_conditional(s3_server):
    url = f"{s3_server['url']}/lock-test/exp/lock.json"
    a = ExperimentLock(url, "run-a", heartbeat_s=3600).acquire()
    with pytest.raises(ExperimentLocked, match="run-a"):
        ExperimentLock(url, "run-b").acquire()
    a.heartbeat()
    a.check()
    # a stale owner (old heartbeat, other host) is taken over with one conditional write
    data = json.loads(storage.read_bytes(url))
    storage.write_bytes_atomic(
        url, json.dumps({**data, "host": "elsewhere", "heartbeat_at": time.time() - 999}).encode()
    )
    b = ExperimentLock(url, "run-b", stale_after_s=60).acquire()
    a.heartbeat()
    with pytest.raises(ExperimentLocked):
        a.check()
    a.release()
    assert json.loads(storage.read_bytes(url))["run_id"] == "run-b"
    b.release()
    assert not storage.exists(url)


def test_a_lock_that_cannot_be_renewed_stops_the_run_before_the_lease_expires():
    """Renewals that fail (every PUT of the lock answered 500) end the lease one heartbeat before
    another run could count it as stale: check() raises LeaseExpired naming the error, and a second
    run that takes the stale lock over afterwards is the only writer."""
    from ppoflow.infra.experiment.lock import LeaseExpired
    from tests.support.faulty_s3 import BUCKET, faulty_s3

    with faulty_s3() as s3:
        url = f"s3://{BUCKET}/lease/exp/lock.json"
        messages: list[str] = []
        a = ExperimentLock(url, "run-a", heartbeat_s=0.3, stale_after_s=4.0, log=messages.append).acquire()
        s3.fail("PUT", r"/lease/exp/lock\.json$", times=10_000)
        while not s3.failed:  # renewals are one at a time: the last success is behind the first failure
            time.sleep(0.01)
        renewed = a.renewed_at
        deadline = renewed + 4.0
        while not a.lost and time.time() < deadline + 5:
            time.sleep(0.05)
        lost_at = time.time()
        assert a.lost and lost_at < deadline, (lost_at - renewed, messages)
        with pytest.raises(
            LeaseExpired, match=r"could not renew the experiment lock s3:.*lease.*\(last error: OSError"
        ):
            a.check()
        assert any("stopped writing" in m for m in messages)  # said in the run's log too
        while any(t.name == "ppoflow-lock-renewal" for t in threading.enumerate()):
            time.sleep(0.05)  # a renewal cut off at the lease's end may still be retrying its PUT
        s3.clear()
        time.sleep(max(0.0, deadline + 0.2 - time.time()))
        b = ExperimentLock(url, "run-b", stale_after_s=4.0).acquire()
        b.check()
        with pytest.raises(LeaseExpired):
            a.check()  # the run that lost its lease stays stopped
        a.release()
        assert json.loads(storage.read_bytes(url))["run_id"] == "run-b"
        b.release()


def test_a_renewal_that_hangs_ends_the_lease_in_time():
    """A storage that does not answer (every PUT of the lock held for 8 s, twice the time after
    which another run may take the lock over) still ends the lease one heartbeat before it could
    be counted stale, with an error that says the storage did not answer."""
    from ppoflow.infra.experiment.lock import LeaseExpired
    from tests.support.faulty_s3 import BUCKET, faulty_s3

    with faulty_s3() as s3:
        url = f"s3://{BUCKET}/hang/exp/lock.json"
        a = ExperimentLock(url, "run-a", heartbeat_s=0.3, stale_after_s=4.0).acquire()
        s3.stall("PUT", r"/hang/exp/lock\.json$", seconds=8.0)
        while not s3.stalled:  # a renewal is held: the one before it was the last to succeed
            time.sleep(0.01)
        renewed = a.renewed_at
        while not a.lost and time.time() < renewed + 9:
            time.sleep(0.05)
        lost_after = time.time() - renewed
        assert a.lost and lost_after < 4.0, lost_after
        with pytest.raises(LeaseExpired, match=r"TimeoutError: no answer from the storage"):
            a.check()
        s3.clear()
        a.release()


@pytest.mark.parametrize("where", ["local", "memory", "s3"])
def test_of_runs_taking_over_one_stale_lock_at_once_one_gets_it(where, tmp_path, request):
    """The takeover is one replace-if-match on every storage (memory:// included, which was a
    check-then-write before it had a backend): of several runs that all judge the lock stale and
    take it over at the same moment, exactly one holds it after, and the others are refused."""
    if where == "local":
        url = str(tmp_path / "exp" / "lock.json")
    elif where == "memory":
        url = f"memory://lock-{uuid.uuid4().hex[:8]}/lock.json"
    else:
        url = f"{request.getfixturevalue('s3_server')['url']}/lock-{uuid.uuid4().hex[:8]}/lock.json"
    stale = {"run_id": "dead", "host": "elsewhere", "pid": 1, "token": "t", "heartbeat_at": time.time() - 999}
    storage.write_json_atomic(url, stale)
    n = 4
    start = threading.Barrier(n)
    outcome: dict[str, object] = {}

    def take(i: int) -> None:
        lock = ExperimentLock(url, f"run-{i}", heartbeat_s=3600, stale_after_s=60)
        start.wait()
        try:
            outcome[lock.run_id] = lock.acquire()
        except ExperimentLocked as exc:
            outcome[lock.run_id] = exc

    serial = unpreempted_requests() if where == "s3" else contextlib.nullcontext()
    with serial:  # on S3: moto's own check-then-store is not atomic (tests.support.s3_server)
        threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    holders = [run for run, got in outcome.items() if isinstance(got, ExperimentLock)]
    assert len(outcome) == n and len(holders) == 1, outcome
    assert json.loads(storage.read_bytes(url))["run_id"] == holders[0]
    for got in outcome.values():
        if isinstance(got, ExperimentLock):
            got.check()
            got.release()
        else:
            assert holders[0] in str(got)  # refused, naming the run that holds it now
    assert not storage.exists(url)
