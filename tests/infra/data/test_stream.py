"""Training data that grows: directories and globs, new files visited first, records that make a
rerun read what the first attempt read, and changed or vanished files refused by name."""

from __future__ import annotations

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.infra.data.prompts import DataError, PromptDataset
from ppoflow.infra.data.stream import expand_train_files, new_files, open_stream
from tests.infra.data.test_prompts import write_prompts
from tests.support.configs import make_config


def _cfg(tmp_path, entries):
    return make_config(tmp_path, "unused-model", entries, **{"data.seed": 5})


def test_entries_expand_to_files_by_name_on_local_and_memory_urls(tmp_path):
    d = tmp_path / "drop"
    d.mkdir()
    for name in ("b.parquet", "a.parquet", "c.parquet"):
        write_prompts(d / name, 2)
    (d / "notes.txt").write_text("not data")
    single = write_prompts(tmp_path / "single.parquet", 2)
    assert expand_train_files([str(d), single]) == [
        str(d / n) for n in ("a.parquet", "b.parquet", "c.parquet")
    ] + [single]
    assert expand_train_files([str(d / "[ab].parquet"), str(d / "*.parquet")]) == [
        str(d / n) for n in ("a.parquet", "b.parquet", "c.parquet")
    ]
    mem = fsspec.filesystem("memory")
    for name in ("y.parquet", "x.parquet"):
        with mem.open(f"/growing/{name}", "wb") as f:
            pq.write_table(pa.table({"a": [1]}), f)
    assert expand_train_files(["memory://growing/*.parquet"]) == [
        "memory:///growing/x.parquet",
        "memory:///growing/y.parquet",
    ]
    with pytest.raises(DataError, match=r"'.*nothing-\*\.parquet' matches no file"):
        expand_train_files([str(tmp_path / "nothing-*.parquet")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="directory with no .parquet file"):
        expand_train_files([str(tmp_path / "empty")])


def test_new_rows_come_first_and_a_rerun_reads_what_the_first_attempt_read(tmp_path):
    d = tmp_path / "drop"
    d.mkdir()
    a, b = write_prompts(d / "a.parquet", 5), write_prompts(d / "b.parquet", 4, 5)
    cfg = _cfg(tmp_path, [str(d)])
    root = str(tmp_path / "exp")

    first = open_stream(cfg, root, "run-1", 0, [])
    assert [(r["url"], r["rows"], r["joined"]) for r in first.records] == [(a, 5, 1), (b, 4, 1)]
    assert first.fresh is None and first.start_cursor({"epoch": 0, "offset": 0}, 0) == {
        "epoch": 0,
        "offset": 0,
    }
    # the first run trained 1 epoch and 3 rows into the next; then a third file arrives
    c = write_prompts(d / "c.parquet", 3, 100)
    assert new_files(cfg.data.train_files, first.records) == [c]
    second = open_stream(cfg, root, "run-2", 4, first.records)
    assert [(r["url"], r["joined"]) for r in second.records] == [(a, 1), (b, 1), (c, 5)]
    assert second.fresh == 9
    cursor = second.start_cursor({"epoch": 1, "offset": 3}, 4)
    assert cursor == {"epoch": 2, "offset": 0, "fresh": 9}
    rows, after = second.dataset.take(cursor, 4, seed=5, shuffle=True)
    # the reference: rows 9..11 (file c) in some order, then one of the old rows, then the rest
    assert sorted(r.index for r in rows[:3]) == [9, 10, 11]
    assert all(second.dataset.where(r.index).startswith(c) for r in rows[:3])
    assert rows[3].index < 9 and after == {"epoch": 2, "offset": 4, "fresh": 9}
    epoch2, end = second.dataset.take(cursor, 12, seed=5, shuffle=True)
    assert sorted(r.index for r in epoch2) == list(range(12)) and end == {"epoch": 3, "offset": 0}
    ordinary = PromptDataset([a, b, c]).order(3, 5, True)
    assert np.array_equal(second.dataset.order(3, 5, True), ordinary)  # later epochs: as before

    # more files arrive; a retried attempt of run 2, and another run after iteration 4, read
    # the files (and rows) run 2 read
    write_prompts(d / "d.parquet", 2, 200)
    for key in ("run-2", "run-3"):
        again = open_stream(cfg, root, key, 4, first.records)
        assert again.records == second.records and again.fresh == 9
        assert again.dataset.take(cursor, 4, seed=5, shuffle=True)[0] == rows
    # the run after the next commit picks the fourth file up
    later = open_stream(cfg, root, "run-4", 6, second.records)
    assert [r["url"] for r in later.records][-1] == str(d / "d.parquet") and later.fresh == 12


def test_a_changed_or_vanished_file_that_was_read_fails_naming_it(tmp_path):
    d = tmp_path / "drop"
    d.mkdir()
    a, b = write_prompts(d / "a.parquet", 5), write_prompts(d / "b.parquet", 4, 5)
    cfg = _cfg(tmp_path, [str(d)])
    root = str(tmp_path / "exp")
    read = open_stream(cfg, root, "run-1", 0, []).records
    write_prompts(d / "b.parquet", 4, 50)  # same name, other rows
    with pytest.raises(
        DataError, match=rf"{b} changed after the experiment read it \(at iteration 1: 4 rows"
    ):
        open_stream(cfg, root, "run-2", 3, read)
    write_prompts(d / "b.parquet", 4, 5)  # restored: bytes equal again
    open_stream(cfg, root, "run-2", 3, read)
    (d / "a.parquet").unlink()
    for key, after in (("run-3", 3), ("run-4", 7)):  # a recorded run, and a new listing
        with pytest.raises(DataError, match=rf"{a} was trained on by this experiment but is no longer"):
            open_stream(cfg, root, key, after, read)
