"""ppoflow.infra.rewards.rules with math-verify: a table of responses the old extractor (the
number after the last ``####``) misses or gets wrong, scored right now; the GSM8K format kept
where it is the dataset's own; the MATH sources registered; threads parse too."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ppoflow.infra.rewards import get_reward_fn, score_batch
from ppoflow.infra.rewards.rules import (
    MATH_SOURCES,
    extract_gsm8k_answer,
    gsm8k_score,
    math_score,
    math_verify_score,
)

# (response, ground truth, what the old extractor gave, the score now)
GSM8K_MISSES = [
    ("so she has \\boxed{72} clips", "72", None, 1.0),
    ("\\boxed{1,234}", "1234", None, 1.0),
    ("the total is $\\boxed{18}$ dollars", "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18", None, 1.0),
    ("\\boxed{71}", "72", None, 0.0),  # an answer, wrong: the format score
]

# (response, ground truth, the score): equivalent forms the old extractor cannot compare
MATH_CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{(1,2]}", "(1, 2]", 1.0),
    ("\\boxed{\\{1, 2, 3\\}}", "\\{3,2,1\\}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("first \\boxed{3}, no: \\boxed{4}", "4", 1.0),  # the last boxed answer counts
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("the answer is 12", "12", 1.0),  # no box: the last expression
    ("I do not know", "12", 0.0),
    ("We get \\boxed{5}.", "Adding gives $\\boxed{5}$.", 1.0),  # a solution as the ground truth
]


@pytest.mark.parametrize("response, truth, old, expected", GSM8K_MISSES)
def test_gsm8k_boxed_answers_the_old_extractor_missed(response, truth, old, expected):
    assert extract_gsm8k_answer(response) == old  # the old extractor finds nothing
    assert gsm8k_score("openai/gsm8k", response, truth, {"format_score": 0.1}) == pytest.approx(
        expected if expected else 0.1
    )


@pytest.mark.parametrize("response, truth, expected", MATH_CASES)
def test_math_equivalent_forms(response, truth, expected):
    assert math_score("lighteval/MATH", response, truth) == expected
    assert math_verify_score("my/dataset", response, truth) == expected
    old = extract_gsm8k_answer(response)
    if expected:  # the old extractor missed every one of these
        assert old is None


def test_gsm8k_keeps_its_own_format():
    # the dataset's #### answer wins over a box; a bare number is no answer (the GSM8K prompt asks for ####)
    assert gsm8k_score("gsm8k", "\\boxed{5}\n#### 72", "72") == 1.0
    assert gsm8k_score("gsm8k", "the answer is 72", "72") == 0.0


def test_math_sources_are_registered_and_score_in_threads():
    for source in MATH_SOURCES:
        assert get_reward_fn(source) is math_score
    rows = [(r, t) for r, t, _ in MATH_CASES]
    want = [e for _, _, e in MATH_CASES]
    with ThreadPoolExecutor(2) as pool:  # no signal.alarm off the main thread: parses without it
        got = pool.submit(score_batch, ["HuggingFaceH4/MATH-500"] * len(rows), *zip(*rows)).result()
    assert got.tolist() == want
    with pytest.raises(ValueError, match="ground truth is empty"):
        math_score("math", "\\boxed{1}", "")
