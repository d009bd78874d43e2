"""ppoflow.infra.rewards: rule rewards by data source, the registry, custom functions by import path, and the checks on what they return."""

from __future__ import annotations

import numpy as np
import pytest

from ppoflow.infra import rewards
from ppoflow.infra.rewards import (
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    register_reward,
    score_batch,
)


def my_score(data_source, solution_str, ground_truth, extra_info):
    """Custom reward used by the tests by import path: length match, as a dict with extra fields."""
    return {"score": float(len(solution_str) == int(ground_truth)), "length": len(solution_str)}


NOT_A_FUNCTION = 3


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is\n#### 72", "72", 1.0),
        ("#### 71", "72", 0.0),  # wrong
        ("the answer is 72", "72", 0.0),  # no #### answer
        ("#### 1,234", "1234", 1.0),  # commas in the response
        ("#### 1234", "1,234", 1.0),  # commas in the ground truth
        ("#### $1,234.00", "1234", 1.0),  # dollar sign, decimals
        ("#### -5", "-5", 1.0),  # negative
        ("#### -$5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 0.5", "0.50", 1.0),  # decimals compare numerically
        ("#### .5", "0.5", 1.0),
        ("#### 3.14.", "3.14", 1.0),  # trailing full stop
        ("#### 1\nwait, no\n#### 2", "2", 1.0),  # the last answer counts
        ("#### 2\n#### ", "2", 1.0),  # ... the last parsable one
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # a full GSM8K solution as truth
    ],
)
def test_gsm8k_cases(response, truth, expected):
    assert gsm8k_score("openai/gsm8k", response, truth, None) == expected


def test_gsm8k_format_score_and_bad_truth():
    assert gsm8k_score("gsm8k", "#### 7", "8", {"format_score": 0.1}) == pytest.approx(0.1)
    assert gsm8k_score("gsm8k", "no answer", "8", {"format_score": 0.1}) == 0.0
    assert extract_gsm8k_answer("nothing here") is None
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_score("gsm8k", "#### 7", "seven", None)


def test_score_batch_registry_and_dtype():
    scores = score_batch(
        ["openai/gsm8k", "gsm8k", "openai/gsm8k"],
        ["#### 4", "#### 5", "none"],
        ["4", "4", "4"],
        [None, None, None],
    )
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]
    assert get_reward_fn("openai/gsm8k") is gsm8k_score


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


def test_register_reward_and_duplicates():
    @register_reward("tests/const")
    def const(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    try:
        assert score_batch(["tests/const"], ["x"], [None]).tolist() == [0.25]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("tests/const")(lambda *a: 1.0)
        register_reward("tests/const", override=True)(lambda *a: 0.5)
        assert score_batch(["tests/const"], ["x"], [None]).tolist() == [0.5]
    finally:
        rewards._REGISTRY.pop("tests/const", None)


def test_custom_function_by_import_path(tmp_path):
    scores, info = rewards.score_batch_with_info(
        ["any", "thing"],
        ["abc", "ab"],
        ["3", "3"],
        [None, None],
        custom_function="tests.infra.test_rewards:my_score",
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
        ("tests.infra.test_rewards", ValueError, "package.module:function"),
        ("no_such_pkg.mod:fn", ImportError, "cannot import module 'no_such_pkg.mod'"),
        ("tests.infra.test_rewards:missing", AttributeError, "has no 'missing'.*my_score"),
        ("tests.infra.test_rewards:NOT_A_FUNCTION", TypeError, "not a function"),
        ("/nonexistent/file.py:fn", FileNotFoundError, "does not exist"),
    ],
)
def test_custom_function_bad_paths(path, error, match):
    with pytest.raises(error, match=match):
        score_batch(["x"], ["a"], ["a"], [None], custom_function=path)


def test_bad_return_values_are_named():
    with pytest.raises(TypeError, match="returned a str"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: "1.0")
    with pytest.raises(ValueError, match="without a 'score' key"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: {"acc": 1})
    with pytest.raises(ValueError, match="non-finite"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: float("nan"))
    with pytest.raises(ValueError, match="lengths differ"):
        score_batch(["x", "y"], ["a"], ["a"], None)


def test_a_raising_reward_function_is_named_with_the_row_and_not_retryable():
    from ppoflow.tasks.step import is_permanent

    with pytest.raises(rewards.RewardError) as err:
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
