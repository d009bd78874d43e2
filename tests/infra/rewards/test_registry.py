"""ppoflow.infra.rewards.registry: rewards registered by data source (functions and batch
scorers), the errors for a source nobody registered and for a second registration, and the
reward ``reward.custom_function`` names."""

from __future__ import annotations

import pytest

from ppoflow.infra.rewards import registry
from ppoflow.infra.rewards.registry import (
    BatchScorer,
    ScoreRequest,
    get_reward_fn,
    load_custom_function,
    register_reward,
    reward_name,
)

NOT_A_FUNCTION = 3


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


class Echo(BatchScorer):
    """Scores each request by the number in its extra_info (for the tests)."""

    def score(self, requests):
        return [float(r.extra_info["n"]) for r in requests]


ECHO = Echo()


@pytest.fixture
def clean_registry():
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_register_a_function_and_a_scorer_and_refuse_a_second_registration(clean_registry):
    assert register_reward("tests/len")(length_score) is length_score
    scorer = Echo()
    register_reward("tests/echo", "tests/echo2")(scorer)
    assert get_reward_fn("tests/len") is length_score
    assert get_reward_fn("tests/echo") is scorer and get_reward_fn("tests/echo2") is scorer
    register_reward("tests/len")(length_score)  # the same function again: no conflict
    with pytest.raises(
        ValueError, match=r"already registered for data_source 'tests/echo'.*Echo.*override=True"
    ):
        register_reward("tests/echo")(length_score)
    register_reward("tests/echo", override=True)(length_score)
    assert get_reward_fn("tests/echo") is length_score
    with pytest.raises(TypeError, match="neither a function nor a BatchScorer"):
        register_reward("tests/x")(3)
    with pytest.raises(ValueError, match="non-empty data_source"):
        register_reward()


def test_unknown_data_source_names_the_known_ones_and_how_to_register():
    with pytest.raises(KeyError) as err:
        get_reward_fn("my/dataset")
    msg = str(err.value)
    assert "my/dataset" in msg and "openai/gsm8k" in msg
    assert "register_reward" in msg and "reward.custom_function" in msg


def test_custom_rewards_by_import_path():
    here = "tests.infra.rewards.test_registry"
    assert load_custom_function(f"{here}:length_score") is length_score
    assert load_custom_function(f"{here}:ECHO") is ECHO
    built = load_custom_function(f"{here}:Echo")  # a BatchScorer class: built once, no arguments
    assert isinstance(built, Echo) and load_custom_function(f"{here}:Echo") is built
    with pytest.raises(
        TypeError, match=r"reward.custom_function=.*'NOT_A_FUNCTION' is a int, not a function"
    ):
        load_custom_function(f"{here}:NOT_A_FUNCTION")
    with pytest.raises(TypeError, match="not a function or a BatchScorer"):
        load_custom_function(f"{here}:ScoreRequest")  # a class that is not a scorer


def test_score_request_from_a_dataset_row_and_reward_names():
    row = {"data_source": "d", "ground_truth": "1", "raw_prompt": [{"role": "user", "content": "q"}], "x": 0}
    assert ScoreRequest.from_row(row, "a") == ScoreRequest("d", "a", "1", None, row["raw_prompt"])
    assert ScoreRequest.from_row({}, "a") == ScoreRequest("", "a")
    assert reward_name(length_score) == f"{__name__}:length_score"
    assert reward_name(ECHO) == f"{__name__}:Echo"
    assert reward_name(length_score, "pkg.mod:fn") == "pkg.mod:fn"
