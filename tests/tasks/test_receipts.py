"""ppoflow.tasks.receipts: a task's receipt is reused only for the same inputs, and a downstream
task's inputs name the receipts it consumed by their stamps (a recomputed rollout invalidates
everything computed from the old one)."""

from __future__ import annotations

from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths
from ppoflow.tasks.receipts import GenerateReceipt, Receipt, find_receipt, input_stamps, write_receipt


def test_receipts_are_reused_only_with_the_same_inputs(tmp_path):
    paths = ExperimentPaths(str(tmp_path / "exp"))
    out = paths.file(2, "rollout.arrow")
    storage.write_bytes_atomic(out, b"x")
    gen = write_receipt(
        paths,
        GenerateReceipt(
            task="generate",
            iteration=2,
            outputs={"rollout": out},
            next_cursor={"epoch": 0, "offset": 8},
            seed=3,
        ),
    )
    assert gen.stamp and storage.read_json(paths.receipt(2, "generate"))["stamp"] == gen.stamp

    # checkpoints travel as experiment-relative references, cursors as canonical JSON
    inputs = input_stamps(paths, (paths.checkpoint("actor", 1), {"epoch": 0, "offset": 4}), {})
    assert inputs == {"0": "checkpoints/actor/000001", "1": '{"epoch": 0, "offset": 4}'}
    stored = write_receipt(paths, gen.model_copy(update={"inputs": inputs}))
    found = find_receipt(paths, 2, "generate", GenerateReceipt, inputs=inputs)
    assert found is not None and found.stamp == stored.stamp
    other = input_stamps(paths, (paths.checkpoint("actor", 0), {"epoch": 0, "offset": 4}), {})
    assert find_receipt(paths, 2, "generate", GenerateReceipt, inputs=other) is None

    # downstream tasks name the receipts they consume by stamp: a recomputed rollout changes them
    down = input_stamps(paths, (stored,), {})
    assert down == {"0": f"generate:{stored.stamp}"}
    again = write_receipt(paths, stored.model_copy(update={"stamp": ""}))
    assert input_stamps(paths, (again,), {}) != down
    assert isinstance(Receipt(task="t", iteration=1).inputs, dict)


def test_a_receipt_whose_outputs_are_gone_is_not_reused(tmp_path):
    paths = ExperimentPaths(str(tmp_path / "exp"))
    out = paths.file(1, "values.arrow")
    storage.write_bytes_atomic(out, b"x")
    write_receipt(paths, Receipt(task="values", iteration=1, outputs={"values": out}))
    assert find_receipt(paths, 1, "values", Receipt, inputs={}) is not None
    storage.rm(out)
    assert find_receipt(paths, 1, "values", Receipt, inputs={}) is None
