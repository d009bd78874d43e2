"""Room for the snapshots (``ppoflow.infra.preflight.disk``): a snapshot's size by hand (weights and
AdamW's two moments: 12 bytes a parameter with float32 master weights, as the 1.5B OLMo-2 row of
docs/models.md wrote, 17.82 GB for 1,484.9M parameters; LoRA: the adapters only), and the three
outcomes against the free space: a problem below one snapshot, a note below ``keep_last + 1``, a
line otherwise; the free space of a real local directory; remote storage is not measured."""

from __future__ import annotations

from ppoflow.infra.preflight.disk import check_disk, snapshot_bytes
from ppoflow.infra.preflight.memory_fixes import model_shapes
from ppoflow.infra.preflight.report import Checks
from tests.infra.preflight.test_memory_check import config
from tests.infra.preflight.test_model_shape import QWEN_05B

N_05B = 494_032_768  # Qwen2.5-0.5B, as published


def test_a_snapshot_is_weights_and_two_moments(tmp_path):
    cfg = config(tmp_path, QWEN_05B)  # GAE: the critic is the same base with a value head
    shapes = model_shapes(cfg)
    assert shapes is not None
    sizes = snapshot_bytes(cfg, shapes)
    value_params = N_05B + 896 + 1  # tied embeddings: the value head (896 -> 1) is all it adds
    assert sizes == {"actor": 12 * N_05B, "critic": 12 * value_params}
    grpo = config(tmp_path, QWEN_05B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4})
    assert snapshot_bytes(grpo, shapes) == {"actor": 12 * N_05B}
    lora = config(
        tmp_path, QWEN_05B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4, "actor.lora.rank": 8}
    )
    adapters = shapes["policy"].lora_params(lora.actor.lora)
    assert 0 < adapters < N_05B // 50
    assert snapshot_bytes(lora, shapes) == {"actor": 12 * adapters}


def test_free_space_below_one_snapshot_is_a_problem_and_below_the_kept_ones_a_note(tmp_path):
    cfg = config(
        tmp_path, QWEN_05B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4, "checkpoint.keep_last": 2}
    )
    one = 12 * N_05B
    short = Checks()
    check_disk(cfg, short, free=one - 1)
    assert len(short.problems) == 1
    problem = short.problems[0]
    assert problem.where == f"storage.root={tmp_path / 'runs'}"
    assert "a snapshot of this run is 5.5 GiB" in problem.found and "fail" in problem.found
    assert "storage.root" in problem.fix and "lora" in problem.fix
    tight = Checks()
    check_disk(cfg, tight, free=3 * one - 1)  # keep_last 2 + the one being written
    assert not tight.problems and len(tight.report.notes) == 1
    assert "keep_last 2" in tight.report.notes[0] and "16.6 GiB" in tight.report.notes[0]
    room = Checks()
    check_disk(cfg, room, free=3 * one)
    assert not room.problems and not room.report.notes
    assert room.report.passed == ["storage: 16.6 GiB free for snapshots of 5.5 GiB (actor 5.5 GiB)"]


def test_the_free_space_of_a_local_root_is_measured_and_remote_storage_is_not(tmp_path):
    import shutil

    cfg = config(tmp_path, QWEN_05B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4})
    local = Checks()
    check_disk(cfg, local)  # the root does not exist yet: its nearest existing parent is measured
    free = shutil.disk_usage(tmp_path).free
    if free >= 12 * N_05B * 4:
        assert local.report.passed and local.report.passed[0].startswith("storage: ")
    else:
        assert local.problems or local.report.notes
    remote = Checks()
    check_disk(config(tmp_path, QWEN_05B, **{"storage.root": "s3://bucket/runs"}), remote)
    assert not remote.problems and not remote.report.notes and not remote.report.passed


def test_a_resumed_experiment_short_of_room_gets_a_note_not_a_refusal(tmp_path):
    """Its snapshots are on that disk already and its user may be freeing room as it runs: the run
    starts, and a write that meets the full disk ends it naming the disk (test_failing_cli.py)."""
    cfg = config(tmp_path, QWEN_05B, **{"algorithm.adv_estimator": "grpo", "rollout.n": 4})
    experiment = tmp_path / "runs" / "e"
    experiment.mkdir(parents=True)
    (experiment / "manifest.json").write_text("{}")
    short = Checks()
    check_disk(cfg, short, free=640 << 10)
    assert not short.problems and len(short.report.notes) == 1
    note = short.report.notes[0]
    assert "has 0.6 MiB free and a snapshot of this run is 5.5 GiB" in note and "will not fit" in note
