"""ppoflow.infra.remote.driver.group_start: a failed start read from torch's launcher report — the
first rank to end, its exit status and error line — and classified: an error exit or a worker
class that does not import is a GroupCannotStart (not retried); a rank killed by a signal, a
timeout, or a failure after the start is left as it was (retried). The real launcher's report is
exercised in tests/infra/remote/driver/test_group.py and tests/scenarios/test_failing_early.py."""

from __future__ import annotations

from ppoflow.infra.remote.driver.group_start import classify, root_cause
from ppoflow.infra.remote.errors import GroupCannotStart, RankFailure, error_types

REPORT = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "entry.py", line 10, in <module>
[rank1]: RuntimeError: [enforce fail at gloo/transport/tcp/device.cc] no such interface: nosuchif0
[rank0]: ValueError: an earlier line of another rank
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ppoflow.infra.remote.rank.entry FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_23:00:00
  host      : somehost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 4242)
  error_file: <N/A>
============================================================
"""


def test_the_launchers_report_names_the_first_rank_to_end_and_its_error():
    assert root_cause(REPORT.format(code=1)) == (
        1,
        1,
        "RuntimeError: [enforce fail at gloo/transport/tcp/device.cc] no such interface: nosuchif0",
    )
    assert root_cause(REPORT.format(code=-9))[:2] == (1, -9)
    assert root_cause("no report in this output") is None


FORKED_REPORT = """\
[rank0]:[ppoflow] starting
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
run_script_path FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_12:12:38
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 19470)
  error_file: /tmp/torchelastic_x/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "entry.py", line 280, in main
      threads = int(env.get("PPOFLOW_RANK_THREADS"))
  ValueError: invalid literal for int() with base 10: 'bogus'
============================================================
ValueError: an exception after the report is not the rank's
"""


def test_a_forked_ranks_error_line_is_read_from_the_report():
    # a rank forked by the launcher prints no traceback of its own: the report carries it
    assert root_cause(FORKED_REPORT) == (0, 1, "ValueError: invalid literal for int() with base 10: 'bogus'")


def test_an_error_exit_while_starting_cannot_start_and_a_signal_may_be_retried():
    failed = RankFailure("the group did not start", None, "__start__")
    cannot = classify(failed, REPORT.format(code=1))
    assert isinstance(cannot, GroupCannotStart)
    assert "rank 1 exited with status 1 while starting" in str(cannot)
    assert "no such interface: nosuchif0" in str(cannot)
    # killed by a signal (out of memory, say): a new start may work
    assert classify(failed, REPORT.format(code=-9)) is failed
    # no report (a connect timeout): retried
    assert classify(failed, "") is failed
    # a failure of a call after the start is not a start's
    later = RankFailure("rank 0 raised", 0, "generate_sequences")
    assert classify(later, REPORT.format(code=1)) is later


def test_a_worker_class_that_does_not_import_cannot_start():
    raised = RankFailure(
        "rank 0 raised in __init__\n--- traceback ---\nModuleNotFoundError: no module named x",
        0,
        "__init__",
        tuple(error_types(ModuleNotFoundError("x"))),
    )
    cannot = classify(raised, "")
    assert isinstance(cannot, GroupCannotStart) and "does not import" in str(cannot)
    # any other exception in the worker's constructor may depend on the moment (a busy port)
    other = RankFailure("rank 0 raised in __init__", 0, "__init__", tuple(error_types(OSError("busy"))))
    assert classify(other, "") is other
