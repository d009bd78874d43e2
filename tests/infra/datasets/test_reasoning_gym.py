"""ppoflow.infra.datasets.reasoning_gym and the reasoning-gym reward: files written from two real
reasoning-gym tasks, checked against the library itself (the entries it generates for the
task's seed, its own scorer), with no question in both files; the errors (the command line's: tests/cli/test_data.py)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import time

import pyarrow.parquet as pq
import pytest

from ppoflow.infra.datasets.reasoning_gym import TaskMix, TaskSpec, _task_seed, split_counts, write_task_mix
from ppoflow.infra.rewards import RewardError, score_batch

rg = pytest.importorskip("reasoning_gym")

MIX = TaskMix(
    tasks=[TaskSpec(name="basic_arithmetic", weight=2), TaskSpec(name="leg_counting")],
    train=24,
    test=9,
    seed=3,
)


def _rows(out, split):
    return pq.read_table(f"{out}/{split}.parquet").to_pylist()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rg"))
    return out, write_task_mix(MIX, out)


def test_split_counts_follow_the_weights():
    assert split_counts(24, [2, 1]) == [16, 8]
    assert split_counts(9, [2, 1]) == [6, 3]
    assert split_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(split_counts(1000, [0.3, 0.2, 0.5])) == 1000


def test_files_hold_the_libraries_entries_with_no_overlap(written):
    out, info = written
    train, test = _rows(out, "train"), _rows(out, "test")
    assert info["counts"] == {
        "basic_arithmetic": {"test": 6, "train": 16},
        "leg_counting": {"test": 3, "train": 8},
    }
    assert (len(train), len(test)) == (24, 9)
    key = lambda r: (r["data_source"], r["prompt"][-1]["content"])  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert len({key(r) for r in train + test}) == 33
    assert [r["extra_info"]["index"] for r in train] == list(range(24))
    for row in train + test:
        task = row["extra_info"]["task"]
        entry = json.loads(row["extra_info"]["reasoning_gym_entry"])
        # the library's own entry for this task's seed and index: the row carries it unchanged
        ref = rg.create_dataset(task, seed=_task_seed(MIX.seed, task), size=400)[
            entry["metadata"]["source_index"]
        ]
        assert row["prompt"][-1]["content"] == ref["question"]
        assert row["reward_model"]["ground_truth"] == ref["answer"]
        assert row["prompt"][0]["role"] == "system" and "<answer>" in row["prompt"][0]["content"]


def test_the_reward_is_the_tasks_own_scorer(written):
    out, _ = written
    rows = _rows(out, "train") + _rows(out, "test")
    sources = [r["data_source"] for r in rows]
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    extras = [r["extra_info"] for r in rows]
    right = [f"Thinking...\n<answer>{t}</answer>" for t in truths]
    wrong = [f"<answer>{int(t) + 1}</answer>" for t in truths]
    assert score_batch(sources, right, truths, extras).tolist() == [1.0] * len(rows)
    got = score_batch(sources, wrong, truths, extras)
    assert (got < 1).all()
    # against the library's scorer on its own entries
    for row, text, score in zip(rows, wrong, got):
        entry = json.loads(row["extra_info"]["reasoning_gym_entry"])
        ref = rg.get_score_answer_fn(row["extra_info"]["task"])(text[8:-9], entry)
        assert score == pytest.approx(ref)
    assert score_batch(sources[:1], ["no tags: " + truths[0]], truths[:1], extras[:1]).tolist() == [0.0]
    with pytest.raises(RewardError, match="reasoning_gym_entry"):
        score_batch(sources[:1], right[:1], truths[:1], [{"index": 0}])


def test_same_seed_same_files_and_held_out_independent_of_train(tmp_path, written):
    out, _ = written
    again = write_task_mix(MIX.model_copy(update={"train": 12}), str(tmp_path))
    assert _rows(tmp_path, "test") == _rows(out, "test")
    assert again["counts"]["leg_counting"] == {"test": 3, "train": 4}


def test_a_scorer_that_needs_what_json_loses_is_refused(tmp_path):
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS, register_dataset

    @dataclasses.dataclass
    class PairConfig:
        seed: int | None = None
        size: int = 10

    class PairTask(ProceduralDataset):
        def __getitem__(self, idx):
            return {"question": f"q{idx}", "answer": "a", "metadata": {"pair": (idx, 1)}}

        def score_answer(self, answer, entry):
            return 1.0 if isinstance(entry["metadata"]["pair"], tuple) and answer == "a" else 0.0

    if "ppoflow_test_pairs" not in DATASETS:
        register_dataset("ppoflow_test_pairs", PairTask, PairConfig)
    with pytest.raises(ValueError, match="cannot be scored from the row; leave it out"):
        write_task_mix(TaskMix(tasks=[TaskSpec(name="ppoflow_test_pairs")], train=2, test=1), str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_the_answer_format_travels_in_the_row(tmp_path):
    mix = TaskMix(
        tasks=[TaskSpec(name="basic_arithmetic")], train=3, test=1, answer_format="tags_or_last_number"
    )
    write_task_mix(mix, str(tmp_path))
    rows = _rows(tmp_path, "train")
    truth = rows[0]["reward_model"]["ground_truth"]
    args = (["reasoning_gym/basic_arithmetic"] * 3, [None] * 3)
    texts = [f"The answer is {truth}.", f"<answer>{truth}</answer> not 7", f"<answer>7</answer> {truth}"]
    extra = [rows[0]["extra_info"]] * 3
    assert score_batch(args[0], texts, args[1], extra).tolist()[:2] == [1.0, 1.0]
    assert score_batch(args[0][:1], texts[2:], args[1][:1], extra[:1]).tolist() == [0.0]  # tags win
    tags_only = {**rows[0]["extra_info"], "answer_format": "tags"}
    assert score_batch(args[0][:1], texts[:1], args[1][:1], [tags_only]).tolist() == [0.0]
    with pytest.raises(RewardError, match="answer_format 'words'"):
        score_batch(args[0][:1], texts[:1], args[1][:1], [{**tags_only, "answer_format": "words"}])


def test_an_unknown_task_is_refused_at_once_naming_the_installed_version(tmp_path):
    """Writing files of a task reasoning-gym does not have, and scoring a row of one, fail at once
    (no dataset is generated first), naming the installed distribution's version: the package's
    own ``__version__`` lags its releases."""
    said = f"reasoning-gym {importlib.metadata.version('reasoning-gym')} has no task 'no_such_task'"
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="; tasks: .*basic_arithmetic") as err:
        write_task_mix(TaskMix(tasks=[TaskSpec(name="no_such_task")], train=2, test=1), str(tmp_path))
    writing = time.monotonic() - t0
    assert said in str(err.value) and not list(tmp_path.iterdir())
    entry = json.dumps({"question": "q", "answer": "1", "metadata": {}})
    t0 = time.monotonic()
    with pytest.raises(RewardError) as err:
        score_batch(
            ["reasoning_gym/no_such_task"], ["<answer>1</answer>"], ["1"], [{"reasoning_gym_entry": entry}]
        )
    scoring = time.monotonic() - t0
    assert said in str(err.value) and "'reasoning_gym/no_such_task'" in str(err.value)
    assert writing < 0.25 and scoring < 0.25, (writing, scoring)
