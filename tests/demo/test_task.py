"""The demo's task: its rule reward, its rows and the warm start's examples."""

from __future__ import annotations

import random

import pytest

from ppoflow.demo import task as demo_task


def test_task_rule_and_rows():
    assert demo_task.score(demo_task.DATA_SOURCE, "7", "7", None) == 1.0
    assert demo_task.score(demo_task.DATA_SOURCE, " 7 ", "7", None) == 1.0
    for wrong in ("8", "77", "7a", "", "seven", "7 8"):
        assert demo_task.score(demo_task.DATA_SOURCE, wrong, "7", None) == 0.0
    from ppoflow.infra.rewards import get_reward_fn

    assert get_reward_fn(demo_task.DATA_SOURCE) is demo_task.score
    rows = demo_task.build_rows(500, seed=3)
    assert rows == demo_task.build_rows(500, seed=3)
    for row in rows:
        a, b = _operands(row["prompt"][0]["content"])
        assert max(a, b) == int(row["reward_model"]["ground_truth"])
    answers = [row["reward_model"]["ground_truth"] for row in rows]
    assert (
        set(answers) == {str(d) for d in range(10)} and max(map(answers.count, set(answers))) < 80
    )  # ~uniform


def _operands(question: str) -> tuple[int, int]:
    assert question.startswith("max(") and question.endswith(")=")
    a, b = question[4:-2].split(",")
    return int(a), int(b)


def test_warm_start_examples_have_random_answers():
    examples = demo_task.warm_start_examples(400, seed=0)
    right = sum(int(resp) == max(_operands(msgs[0]["content"])) for msgs, resp in examples)
    assert 10 < right < 80  # about one in ten: the format, not the answers
    with pytest.raises(ValueError):
        demo_task.make_problem(random.Random(0), max_digit=10)


def test_supervised_examples_have_the_right_answers():
    examples = demo_task.supervised_examples(400, seed=0)
    assert all(int(resp) == max(_operands(msgs[0]["content"])) for msgs, resp in examples)
    assert len({msgs[0]["content"] for msgs, _ in examples}) > 50  # many of the 100 problems
