"""ppoflow.infra.rewards.scoring: rows scored by the reward of their data source or by one custom
reward (by import path, a function or a batch scorer), in row order, and the checks on what a
reward returns."""

from __future__ import annotations

import numpy as np
import pytest

from ppoflow.infra.rewards import registry
from ppoflow.infra.rewards.registry import BatchScorer, RewardError, ScoreRequest, register_reward
from ppoflow.infra.rewards.scoring import score_answer, score_batch, score_batch_with_info, score_requests


def my_score(data_source, solution_str, ground_truth, extra_info):
    """Custom reward used by the tests by import path: length match, as a dict with extra fields."""
    return {"score": float(len(solution_str) == int(ground_truth)), "length": len(solution_str)}


NOT_A_FUNCTION = 3


class Recorder(BatchScorer):
    """A batch scorer that records each call: the score is the response's length, plus 0.5 when
    the row carries a prompt."""

    def __init__(self, results=None):
        self.calls: list[list[ScoreRequest]] = []
        self.results = results

    def score(self, requests):
        self.calls.append(list(requests))
        if self.results is not None:
            return self.results
        return [{"score": len(r.response) + 0.5 * (r.prompt is not None), "judged": 1} for r in requests]


@pytest.fixture
def clean_registry():
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_score_batch_registry_and_dtype():
    scores = score_batch(
        ["openai/gsm8k", "gsm8k", "openai/gsm8k"],
        ["#### 4", "#### 5", "none"],
        ["4", "4", "4"],
        [None, None, None],
    )
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]


def test_unknown_data_source_names_known_ones_and_how_to_register():
    with pytest.raises(KeyError) as err:
        score_batch(["my/dataset"], ["x"], ["1"], [None])
    msg = str(err.value)
    assert (
        "my/dataset" in msg
        and "openai/gsm8k" in msg
        and "register_reward" in msg
        and "custom_function" in msg
    )


def test_a_registered_function_is_used_for_its_rows(clean_registry):
    @register_reward("tests/const")
    def const(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    assert score_batch(["tests/const", "gsm8k"], ["x", "#### 1"], [None, "1"]).tolist() == [0.25, 1.0]
    register_reward("tests/const", override=True)(lambda *a: 0.5)
    assert score_batch(["tests/const"], ["x"], [None]).tolist() == [0.5]


def test_custom_function_by_import_path(tmp_path):
    scores, info = score_batch_with_info(
        ["any", "thing"],
        ["abc", "ab"],
        ["3", "3"],
        [None, None],
        custom_function="tests.infra.rewards.test_scoring:my_score",
    )
    assert scores.tolist() == [1.0, 0.0] and info["length"].tolist() == [3.0, 2.0]
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(ds, s, gt, extra):\n    return 2.0 if s == gt else -1\n")
    assert score_batch(
        ["x", "x"], ["a", "b"], ["a", "a"], None, custom_function=f"{path}:score"
    ).tolist() == [2.0, -1.0]


@pytest.mark.parametrize(
    "path, error, match",
    [
        ("tests.infra.rewards.test_scoring", ValueError, "package.module:function"),
        ("no_such_pkg.mod:fn", ImportError, "cannot import module 'no_such_pkg.mod'"),
        ("tests.infra.rewards.test_scoring:missing", AttributeError, "has no 'missing'.*my_score"),
        ("tests.infra.rewards.test_scoring:NOT_A_FUNCTION", TypeError, "not a function"),
        ("/nonexistent/file.py:fn", FileNotFoundError, "does not exist"),
    ],
)
def test_custom_function_bad_paths(path, error, match):
    with pytest.raises(error, match=match) as err:
        score_batch(["x"], ["a"], ["a"], [None], custom_function=path)
    assert f"reward.custom_function={path!r}" in str(err.value)


def test_bad_return_values_are_named():
    with pytest.raises(TypeError, match="returned a str"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: "1.0")
    with pytest.raises(ValueError, match="without a 'score' key"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: {"acc": 1})
    with pytest.raises(ValueError, match="non-finite"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: float("nan"))
    with pytest.raises(ValueError, match="lengths differ"):
        score_batch(["x", "y"], ["a"], ["a"], None)
    assert score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: np.float64(0.5)).tolist() == [
        0.5
    ]


def test_a_raising_reward_function_is_named_with_the_row_and_not_retryable():
    from ppoflow.tasks.step import is_permanent

    with pytest.raises(RewardError) as err:
        score_batch(
            ["ok/src", "my/src"],
            ["a", "b"],
            ["a", "b"],
            [{"answer": "a"}, {}],
            custom_function="tests.support.rewards:raises_key_error",
        )
    text = str(err.value)
    assert "tests.support.rewards:raises_key_error" in text
    assert "row 1" in text and "data_source 'my/src'" in text
    assert "KeyError: 'answer'" in text and "fix the function" in text
    assert isinstance(err.value.__cause__, KeyError)
    assert is_permanent(err.value)  # the step task's retry_condition_fn does not retry it


def test_a_batch_scorer_gets_its_rows_in_one_call_and_the_scores_land_in_row_order(clean_registry):
    scorer = Recorder()
    register_reward("tests/judged")(scorer)
    requests = [
        ScoreRequest("tests/judged", "aaa", prompt="q0"),
        ScoreRequest("gsm8k", "#### 2", "2"),
        ScoreRequest("tests/judged", "a"),
        ScoreRequest("tests/judged", "aa", prompt=[{"role": "user", "content": "q3"}]),
    ]
    scores, info = score_requests(requests)
    # a plain loop over the rows: the scorer's rule for its rows, GSM8K's for the other
    want = [len(r.response) + 0.5 * (r.prompt is not None) for r in requests]
    want[1] = 1.0
    assert scores.tolist() == want
    assert [[r.response for r in call] for call in scorer.calls] == [["aaa", "a", "aa"]]
    assert np.isnan(info["judged"][1]) and info["judged"][[0, 2, 3]].tolist() == [1.0, 1.0, 1.0]
    # a scorer as the custom reward scores every row, whatever its data source
    custom = Recorder()
    assert score_batch(["x", "y"], ["ab", "c"], [None, None], custom_function=custom).tolist() == [2.0, 1.0]
    assert len(custom.calls) == 1


def test_a_batch_scorer_s_bad_results_and_failures():
    from ppoflow.tasks.step import is_permanent

    with pytest.raises(RewardError, match=r"returned 1 results for 2 rows.*one result per request"):
        score_batch(["x", "y"], ["a", "b"], [None, None], custom_function=Recorder([1.0]))
    with pytest.raises(RewardError, match=r"reward scorer .*Recorder \(row 1, data_source 'y'\).*non-finite"):
        score_batch(["x", "y"], ["a", "b"], [None, None], custom_function=Recorder([1.0, float("inf")]))

    class Down(BatchScorer):
        name = "judge at http://127.0.0.1:9"

        def score(self, requests):
            raise ConnectionError("connection refused")

    # a failure the scorer did not call permanent goes on as it is: the task's retries apply
    with pytest.raises(ConnectionError) as err:
        score_batch(["x", "y"], ["a", "b"], [None, None], custom_function=Down())
    assert not is_permanent(err.value)
    assert err.value.__notes__ == ["while judge at http://127.0.0.1:9 scored rows 0..1 (2 rows)"]


def test_score_answer_scores_one_dataset_row():
    row = {"data_source": "openai/gsm8k", "ground_truth": "408", "extra_info": {"format_score": 0.1}}
    assert score_answer(row, "#### 408") == 1.0
    assert score_answer(row, "#### 7") == pytest.approx(0.1)
    assert score_answer(row, "abc", "tests.infra.rewards.test_scoring:my_score") == 0.0
