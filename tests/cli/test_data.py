"""``ppoflow data reasoning-gym``: the command writes the files of a task mix with levels and
per-task configs (checked against reasoning-gym's own curriculum and scorer), and bad input is one
line naming the task and the fix, with nothing written."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from ppoflow.cli.main import main as cli
from ppoflow.infra.rewards import score_batch

rg = pytest.importorskip("reasoning_gym")


def main(argv: list[str]) -> int:
    return cli(["data", *argv])


def _rows(out, split):
    return pq.read_table(f"{out}/{split}.parquet").to_pylist()


def test_command_line_levels_and_configs(tmp_path, capsys):
    assert (
        main(
            [
                "reasoning-gym",
                "--task", "basic_arithmetic:3",
                "--task", "chain_sum",
                "--level", "chain_sum=1",
                "--config", "basic_arithmetic.max_terms=2",
                "--train", "8", "--test", "4", "--seed", "1",
                "--system-prompt", "none",
                "--out", str(tmp_path),
            ]
        )
        == 0
    )  # fmt: skip
    assert "reasoning_gym/basic_arithmetic: 6 train, 3 held-out" in capsys.readouterr().out
    rows = _rows(tmp_path, "train")
    assert all(len(r["prompt"]) == 1 for r in rows)
    cfgs = {r["extra_info"]["task"]: json.loads(r["extra_info"]["reasoning_gym_config"]) for r in rows}
    assert cfgs["basic_arithmetic"] == {"max_terms": 2}
    curriculum = rg.factory.create_curriculum("chain_sum")
    curriculum.set_global_level(1)
    level1 = dataclasses.asdict(curriculum.generate_configuration({"seed": 0, "size": 1}))
    assert cfgs["chain_sum"] == {k: v for k, v in level1.items() if k not in ("seed", "size")}
    assert score_batch(
        [r["data_source"] for r in rows],
        [f"<answer>{r['reward_model']['ground_truth']}</answer>" for r in rows],
        [None] * len(rows),
        [r["extra_info"] for r in rows],
    ).tolist() == [1.0] * len(rows)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "no_such_task"], "has no task 'no_such_task'"),
        (["--task", "leg_counting", "--config", "leg_counting.bogus=1"], "config {'bogus': 1} is not valid"),
        (["--task", "leg_counting", "--config", "chain_sum.x=1"], "names task 'chain_sum', which is not in the mix"),
        (
            ["--task", "leg_counting", "--config", "leg_counting.max_animals=1", "--config",
             "leg_counting.max_instances=1", "--config", "leg_counting.min_animals=1"],
            "distinct questions in",
        ),
    ],
)  # fmt: skip
def test_errors_name_the_task_and_the_fix(tmp_path, capsys, args, message):
    code = main(["reasoning-gym", *args, "--train", "60", "--test", "10", "--out", str(tmp_path / "x")])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written
