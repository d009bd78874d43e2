"""A flow run's context under its key (``open_run``, ``get_run``, ``close_run``, ``worker_groups``),
without ranks: one open context per run, a clear error for a task outside a run, the ranks' output
in the log of the task using their group, and the run's groups ended (killed on an interrupt) and
the run forgotten however its block ends. The tasks looking it up: tests/tasks/test_step.py."""

from __future__ import annotations

import logging

import pytest

from ppoflow.infra.config import parse_config
from ppoflow.infra.data import storage
from ppoflow.infra.remote.contracts import Build, WorkerMode
from ppoflow.tasks.run.context import abort_run, close_run, get_run, open_run, worker_groups
from ppoflow.tasks.run.groups import RunClosed


@pytest.fixture
def cfg(tmp_path):
    return parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )


def test_one_open_context_per_run_and_a_clear_error_outside_one(cfg):
    ctx = open_run("run-a", cfg, roles={"actor": "rollout"})
    try:
        assert get_run("run-a") is ctx and ctx.groups.builds["actor"] == Build(WorkerMode.ROLLOUT)
        assert ctx.paths.root == cfg.storage.experiment_url
        with pytest.raises(RuntimeError, match="flow run run-a already has an open context"):
            open_run("run-a", cfg)
        abort_run("run-a")  # killed, not yet forgotten: a new context may open under the key
        assert ctx.closed and get_run("run-a") is ctx
        again = open_run("run-a", cfg)
        assert get_run("run-a") is again and not again.closed
    finally:
        close_run("run-a")
    with pytest.raises(
        RuntimeError, match=r"no open ppoflow run 'run-a': ppoflow tasks run inside the `ppo` flow"
    ):
        get_run("run-a")
    close_run("run-a")  # idempotent


def test_the_ranks_output_goes_to_the_task_using_their_group(cfg):
    flow_lines: list[str] = []
    task_lines: list[str] = []

    class Lines(logging.Handler):
        def __init__(self, into: list[str]):
            super().__init__()
            self.into = into

        def emit(self, record: logging.LogRecord) -> None:
            self.into.append(record.getMessage())

    flow_log, task_log = logging.getLogger("test-flow"), logging.getLogger("test-task")
    handlers = [(flow_log, Lines(flow_lines)), (task_log, Lines(task_lines))]
    for log, handler in handlers:
        log.setLevel(logging.INFO)
        log.addHandler(handler)
    ctx = open_run("run-b", cfg, log=flow_log)
    try:
        ctx._emit("critic", "before")  # what the critic group's ranks print
        with ctx.using("critic", task_log):
            ctx._emit("critic", "during")
            ctx._emit("actor", "another group's")
        ctx._emit("critic", "after")
    finally:
        close_run("run-b")
        for log, handler in handlers:
            log.removeHandler(handler)
    assert task_lines == ["during"]
    assert flow_lines == ["before", "another group's", "after"]


def test_a_run_s_storage_options_are_its_protocol_s_defaults_while_it_is_open(tmp_path):
    """The session opens the run's storage before its context (``RunStorage``): the options are
    the protocol's defaults while the run is open, and the defaults from before once it closes."""
    memory = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["train.parquet"]},
            "storage": {
                "root": "memory://ctx-test",
                "experiment": "exp",
                "storage_options": {"skip_instance_cache": True},
            },
        }
    )
    try:
        ctx = open_run("run-c", memory)
        with ctx.storage:
            assert storage.get_default_storage_options("memory") == {"skip_instance_cache": True}
        assert storage.get_default_storage_options("memory") == {}
    finally:
        close_run("run-c")
        storage.set_default_storage_options("memory", None)


def test_a_context_is_fixed_once_it_opens_and_lives_in_its_flow_s_process(cfg):
    """What the session passes in cannot be set again later; a process forked from the flow's
    (its copy of the registry) finds no run, with the rule in the error."""
    import os

    ctx = open_run("run-e", cfg)
    try:
        with pytest.raises(AttributeError, match="fixed once it opens: 'lock'"):
            ctx.lock = object()
        with pytest.raises(AttributeError, match="fixed once it opens: 'rollouts'"):
            ctx.rollouts = object()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the registry's copy holds the run, but no flow here keeps it
            try:
                get_run("run-e")
                os.write(write, b"found")
            except RuntimeError as exc:
                os.write(write, str(exc).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        said = os.read(read, 4096).decode()
        os.close(read)
        assert "no open ppoflow run 'run-e'" in said and "in the flow's own process" in said, said
    finally:
        close_run("run-e")


@pytest.mark.parametrize("ending", [None, ValueError, KeyboardInterrupt])
def test_the_groups_end_with_their_block_however_it_ends(cfg, ending):
    ctx = open_run("run-d", cfg)
    if ending is None:
        with worker_groups("run-d"):
            pass
    else:
        with pytest.raises(ending):
            with worker_groups("run-d"):
                raise ending("the block ends")
    assert ctx.closed
    with pytest.raises(RunClosed):
        ctx.groups.group("actor")
    with pytest.raises(RuntimeError, match="no open ppoflow run 'run-d'"):
        get_run("run-d")
