"""ppoflow.tasks.step: the task decorator every step shares (its Prefect signature, checked against
the step's row as it is decorated, resume from a stored receipt, fault drills) and the retry rule."""

from __future__ import annotations

import pytest

from ppoflow.infra.runtime import faults


def test_retry_rule_fails_deterministic_errors_at_once_and_retries_the_rest():
    from botocore.exceptions import NoCredentialsError
    from prefect.states import Failed

    from ppoflow.infra.checkpoint.sharded import CheckpointError, IncompleteCheckpointError
    from ppoflow.infra.config import ConfigError
    from ppoflow.infra.data.prompts import DataError
    from ppoflow.infra.experiment.lock import ExperimentLocked
    from ppoflow.infra.experiment.manifest import IdentityMismatch
    from ppoflow.infra.preflight import PreflightError, Problem
    from ppoflow.infra.remote.errors import RankFailure, error_types
    from ppoflow.infra.rewards import RewardError
    from ppoflow.tasks.step import retryable

    def failed(exc):
        return Failed(data=exc)

    def in_rank(exc):
        return RankFailure(f"rank 1 raised: {exc}", rank=1, method="m", error_types=tuple(error_types(exc)))

    permanent = [
        ConfigError("bad field"),
        IdentityMismatch("model.path changed"),
        DataError("no prompt column"),
        PreflightError([Problem("data.train_files", "missing", "fix it")]),
        RewardError("non-finite score"),
        IncompleteCheckpointError("no marker"),
        ExperimentLocked("held"),
        PermissionError("AccessDenied"),
        NoCredentialsError(),
        in_rank(DataError("row 3")),
        in_rank(IncompleteCheckpointError("no marker")),
        OSError(28, "No space left on device"),  # a full disk: the next attempt meets it too
        OSError(122, "Disk quota exceeded"),
        OSError("Error writing bytes to file. Detail: [errno 28] No space left on device"),  # pyarrow's
        in_rank(CheckpointError("saving ... failed (rank 1: OSError: [Errno 28] No space left on device)")),
    ]
    transient = [
        RuntimeError("rank 1 died"),
        RankFailure("rank 1 died during 'update_actor' (its link closed)", rank=1, method="update_actor"),
        in_rank(ValueError("a bug that may be flaky")),
        faults.FaultInjected("drill"),
        OSError(121, "We encountered an internal error. Please try again."),  # S3 500 via s3fs
        TimeoutError("call timed out"),
        CheckpointError("saving checkpoint s3://b/x failed: ..."),  # a failed save may pass next time
    ]
    assert [exc for exc in permanent if retryable(None, None, failed(exc))] == []
    assert [exc for exc in transient if not retryable(None, None, failed(exc))] == []


def _probe_task():
    """A task made by ``ppo_task`` (from a row of its own) whose body counts its calls and writes one
    output."""
    from ppoflow.infra.data import storage
    from ppoflow.tasks.graph import StepSpec
    from ppoflow.tasks.receipts import Receipt
    from ppoflow.tasks.step import Step, ppo_task

    calls: list[tuple[int, str]] = []
    row = StepSpec(
        name="probe", stage=0, phase="score", state=("source",), options=("scale",), output="probe"
    )

    @ppo_task(row)
    def probe(step: Step[Receipt], source: str, scale: float = 1.0) -> Receipt:
        """Doubles nothing; records the call."""
        calls.append((step.n, source))
        out = step.file("probe.json")
        storage.write_json_atomic(out, {"scale": scale})
        return step.receipt(outputs={step.output_key: out})

    return probe, calls


def test_the_task_decorator_gives_prefect_the_run_the_iteration_and_the_body_parameters():
    import inspect

    probe, _ = _probe_task()
    assert probe.name == "probe" and probe.task_run_name == "probe-{n}"
    assert list(inspect.signature(probe.fn).parameters) == ["run", "n", "source", "scale"]
    assert inspect.signature(probe.fn).parameters["scale"].default == 1.0
    assert probe.retries == 2 and probe.retry_condition_fn is not None and not probe.persist_result


def test_a_task_wired_otherwise_than_its_row_is_refused_as_it_is_decorated():
    """The row is the single source of a step's wiring: a body whose parameters are not its row's
    reads, gathered receipts, state and options, by name and in order, never becomes a task; the
    error names the step, what the row wires and what the body takes. A step without a row neither."""
    from ppoflow.tasks.graph import STEP, WiringError
    from ppoflow.tasks.step import ppo_task

    def values(step, generate, critic):  # the row wires rollout_critic: the critic of the rollout
        raise AssertionError("never called")

    with pytest.raises(WiringError) as refused:
        ppo_task("values")(values)
    text = str(refused.value)
    assert "step 'values'" in text and "(step, generate, rollout_critic)" in text
    assert "(step, generate, critic)" in text and "test_step" in text

    def swapped(step, advantage, final=False, snapshot=False):  # two options of one type, swapped
        raise AssertionError("never called")

    with pytest.raises(WiringError, match=r"step 'update_actor'.*snapshot=\.\.\., final=\.\.\."):
        ppo_task("update_actor")(swapped)

    def no_gathered(step, generate, kl_coef):  # advantage gathers the score steps' receipts
        raise AssertionError("never called")

    with pytest.raises(WiringError, match=r"step 'advantage'.*\(step, generate, gathered, kl_coef\)"):
        ppo_task("advantage")(no_gathered)

    with pytest.raises(WiringError, match="'nowhere' has no row"):
        ppo_task("nowhere")

    # the tasks of the table: each one's Prefect signature is its row's, with run and n first
    import inspect

    from ppoflow.tasks import TASKS

    for name, task in TASKS.items():
        if name == "commit":  # the pipelined commit takes the iteration's receipts, not a row's inputs
            continue
        row = STEP[name]
        assert list(inspect.signature(task.fn).parameters) == ["run", "n", *row.parameters, *row.options]


def test_a_finished_task_returns_its_receipt_and_new_inputs_run_it_again(tmp_path, monkeypatch):
    from prefect.logging import disable_run_logger

    from ppoflow.infra.config import parse_config
    from ppoflow.infra.data import storage
    from ppoflow.tasks.run import close_run, open_run

    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()
    cfg = parse_config(
        {
            "model": {"path": "m"},
            "data": {"train_files": ["d.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "probe"},
        }
    )
    open_run("run-1", cfg)
    probe, calls = _probe_task()
    with disable_run_logger():  # the body's logger without a Prefect run (Prefect's way to test .fn)
        first = probe.fn("run-1", 3, "checkpoints/actor/000002")
        again = probe.fn("run-1", 3, "checkpoints/actor/000002")
        assert calls == [(3, "checkpoints/actor/000002")]  # the second call found the receipt
        assert again.stamp == first.stamp and again.resumed and not first.resumed
        assert first.timing_s >= 0
        assert storage.read_json(first.outputs["probe"]) == {"scale": 1.0}

        other = probe.fn("run-1", 3, "checkpoints/actor/000001")  # other inputs: work again
        assert len(calls) == 2 and other.stamp != first.stamp

        # a drill after the work: the output and receipt are written, so the retry reuses them
        monkeypatch.setenv(faults.ENV_VAR, "task:probe@4:after")
        with pytest.raises(faults.FaultInjected, match="probe"):
            probe.fn("run-1", 4, "x")
        retried = probe.fn("run-1", 4, "x")
        assert retried.resumed and len(calls) == 3
    close_run("run-1")
    faults.reset()


def test_resources_task_retries_sets_how_often_prefect_runs_a_failing_task(prefect_harness):
    """``with_retries`` (what the flows submit, from ``resources.task_retries``): a task that fails
    with an error a retry may fix runs 1 + retries times (counted by the task itself); the default
    is :data:`TASK_RETRIES` and returns the task unchanged; a negative count is refused."""
    from prefect import flow, task

    from ppoflow.infra.config.system import ResourcesConfig
    from ppoflow.tasks.step import TASK_OPTIONS, TASK_RETRIES, with_retries

    calls: list[int] = []

    @task(name="flaky", **{**TASK_OPTIONS, "retry_delay_seconds": 0})
    def flaky() -> None:
        calls.append(1)
        raise faults.FaultInjected("a drill that a retry does not outlast")

    @flow(name="retries-probe", persist_result=False)
    def run(retries: int) -> None:
        with_retries(flaky, retries).submit().result()

    assert with_retries(flaky, TASK_RETRIES) is flaky
    assert ResourcesConfig().task_retries == TASK_RETRIES == 2
    for retries in (0, 1, TASK_RETRIES):
        calls.clear()
        state = run(retries, return_state=True)
        assert state.is_failed() and len(calls) == 1 + retries, (retries, calls)
    with pytest.raises(ValueError, match="task_retries"):
        ResourcesConfig.model_validate({"task_retries": -1})


def test_a_task_asking_for_a_group_its_row_does_not_run_it_on_is_refused_before_any_group_starts():
    """The typed role a task body asks for (``step.worker(ACTOR_ROLE)``) must be its row's: a body
    that asks for another group is a mis-wiring, refused with the step and both roles named before
    the run's groups are touched (``ctx`` here has none: a call into it would fail otherwise)."""
    import logging

    from ppoflow.infra.remote.contracts import ACTOR_ROLE, CRITIC_ROLE
    from ppoflow.tasks.graph import STEP, WiringError
    from ppoflow.tasks.receipts import Receipt
    from ppoflow.tasks.step import Step

    step = Step(
        ctx=None, n=1, task="values", kind=Receipt, logger=logging.getLogger("t"), spec=STEP["values"]
    )
    with pytest.raises(WiringError, match=r"step 'values' asks for the 'actor' worker group.*'critic'"):
        step.worker(ACTOR_ROLE)
    assert step.held == []
    assert STEP["values"].role == CRITIC_ROLE.name
