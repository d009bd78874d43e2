"""ppoflow.infra.rewards.rules: the GSM8K rule, against a table of answers and ground truths
written by hand, and its registration under both of the dataset's names."""

from __future__ import annotations

import pytest

from ppoflow.infra.rewards import get_reward_fn, known_sources
from ppoflow.infra.rewards.rules import extract_gsm8k_answer, gsm8k_score


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


def test_gsm8k_is_registered_under_both_names():
    assert {"openai/gsm8k", "gsm8k"} <= set(known_sources())
    assert get_reward_fn("openai/gsm8k") is gsm8k_score and get_reward_fn("gsm8k") is gsm8k_score
