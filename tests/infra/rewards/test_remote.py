"""ppoflow.infra.rewards.remote against a real HTTP reward service on 127.0.0.1 (FastAPI +
uvicorn in a process of its own, tests/support/reward_server.py): scores in row order whatever
order the answers arrive in, retries of transient failures, one clear error naming the endpoint
and the rows for everything else, and a bearer token that reaches the service and nothing else."""

from __future__ import annotations

import logging
import time

import pytest
from pydantic import ValidationError

from ppoflow.infra.config import RewardConfig
from ppoflow.infra.config.remote_reward import RemoteRewardConfig
from ppoflow.infra.rewards import RewardError, RewardTypeError, ScoreRequest, score_requests
from ppoflow.infra.rewards.remote import RemoteScorer, RewardServiceError, remote_scorer, run_reward
from tests.support.ports import free_port
from tests.support.reward_server import calls, serve

TOKEN = "s3cr3t-t0ken-value"


@pytest.fixture(scope="module")
def server():
    with serve(free_port(), token=TOKEN) as url:
        yield url


def _cfg(url, route="score", **kw):
    kw = {"timeout_s": 5.0, "retries": 2, "backoff_s": 0.01, "token_env": None, **kw}
    return RemoteRewardConfig(endpoint=f"{url}/{route}", **kw)


def _requests(texts, **extra):
    return [
        ScoreRequest(f"src{i % 2}", t, str(i), {"i": i, **extra}, [{"role": "user", "content": "q"}])
        for i, t in enumerate(texts)
    ]


TEXTS = ["1", "22", "333", "x", "4444", "55555", "", "7777777", "88", "999999999"]


def test_scores_arrive_in_row_order_in_concurrent_batches(server):
    requests = _requests(TEXTS)
    # the first batch answers last: 0.6 s late
    requests[0] = ScoreRequest("src0", "1", "0", {"delay": 0.6})
    scorer = RemoteScorer(_cfg(server, batch_size=3, concurrency=4))
    before = len(calls(server)["sizes"])
    scores, _ = score_requests(requests, scorer)
    expected = [sum(c.isdigit() for c in t) / 10 for t in TEXTS]  # the service's rule, as a plain loop
    assert scores.tolist() == pytest.approx(expected)
    assert sorted(calls(server)["sizes"][before:]) == [1, 3, 3, 3]


def test_dict_scores_bring_their_numbers(server):
    scores, info = score_requests(_requests(["12", "3"], dict=True), RemoteScorer(_cfg(server)))
    assert scores.tolist() == pytest.approx([0.2, 0.1]) and info["digits"].tolist() == [2, 1]


def test_a_500_is_retried_and_then_scores(server, caplog):
    before = calls(server)["calls"].get("flaky", 0)
    with caplog.at_level(logging.WARNING, logger="ppoflow.rewards"):
        scores, _ = score_requests(_requests(["12", "345"]), RemoteScorer(_cfg(server, "flaky")))
    assert scores.tolist() == pytest.approx([0.2, 0.3])
    assert calls(server)["calls"]["flaky"] - before == 2
    assert "HTTP 500 for rows 0..1; retry 1 of 2" in caplog.text


def test_a_stalled_service_is_retried_then_a_retryable_error(server):
    cfg = _cfg(server, "stall", timeout_s=0.3, retries=1)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as err:
        score_requests(_requests(["1"]), RemoteScorer(cfg))
    assert time.monotonic() - t0 < 5
    text = str(err.value)
    assert f"reward service {server}/stall: no answer within 0.3 s for row 0 (2 attempts)" in text
    assert "reward.remote.timeout_s" in text
    assert not isinstance(err.value, RewardError)  # the task may retry it


@pytest.mark.parametrize(
    "route, error, message",
    [
        ("malformed", RewardError, "answered rows 0..1 with malformed JSON"),
        ("wrong-count", RewardError, "answered 1 scores for rows 0..1 (2 rows)"),
        ("nan-text", RewardTypeError, "(row 0, data_source 'src0') returned a str"),
    ],
)
def test_a_bad_answer_names_the_endpoint_and_the_rows(server, route, error, message):
    before = calls(server)["calls"].get(route, 0)
    with pytest.raises(error) as err:
        score_requests(_requests(["1", "2"]), RemoteScorer(_cfg(server, route)))
    assert f"reward service {server}/{route}" in str(err.value) and message in str(err.value)
    # malformed JSON may be a torn answer: retried; a well-formed wrong answer is not
    assert calls(server)["calls"][route] - before == (3 if route == "malformed" else 1)


def test_the_token_reaches_the_service_and_nothing_else(server, monkeypatch, caplog):
    cfg = _cfg(server, "auth", token_env="TEST_REWARD_TOKEN")
    with pytest.raises(RewardError, match="HTTP 401.*check the bearer token"):
        score_requests(_requests(["1"]), RemoteScorer(cfg))  # no token in the environment
    monkeypatch.setenv("TEST_REWARD_TOKEN", TOKEN)
    with caplog.at_level(logging.DEBUG):
        scorer = RemoteScorer(cfg)
        assert score_requests(_requests(["12"]), scorer)[0].tolist() == pytest.approx([0.2])
        with pytest.raises(RewardServiceError) as err:  # a failure after the token was read
            score_requests(
                _requests(["1"]),
                RemoteScorer(_cfg(server, "stall", timeout_s=0.2, retries=1, token_env="TEST_REWARD_TOKEN")),
            )
    seen = caplog.text + str(err.value) + repr(scorer) + scorer.name + cfg.model_dump_json()
    assert TOKEN not in seen and "TEST_REWARD_TOKEN" in cfg.model_dump_json()


def test_the_token_from_a_prefect_secret_block(server, prefect_harness):
    from prefect.blocks.system import Secret

    Secret(value=TOKEN).save("ppoflow-test-reward-token", overwrite=True)
    cfg = _cfg(server, "auth", token_secret="ppoflow-test-reward-token")
    assert score_requests(_requests(["123"]), RemoteScorer(cfg))[0].tolist() == pytest.approx([0.3])
    with pytest.raises(RewardError, match="no such Prefect Secret block"):
        RemoteScorer(_cfg(server, "auth", token_secret="ppoflow-test-no-such-block"))


def test_config_checks_and_the_run_reward():
    with pytest.raises(ValidationError, match="holds credentials"):
        RemoteRewardConfig(endpoint="https://user:pw@judge.example/score")
    with pytest.raises(ValidationError, match="not an http"):
        RemoteRewardConfig(endpoint="judge:8000/score")
    remote = {"endpoint": "http://127.0.0.1:9/score"}
    with pytest.raises(ValidationError, match="keep one of them"):
        RewardConfig.model_validate({"remote": remote, "custom_function": "m:f"})
    cfg = RewardConfig.model_validate({"remote": remote, "rule": False})
    assert run_reward(cfg) is remote_scorer(cfg.remote) and isinstance(run_reward(cfg), RemoteScorer)
    assert run_reward(RewardConfig.model_validate({"custom_function": "m:f"})) == "m:f"
    assert run_reward(RewardConfig()) is None
