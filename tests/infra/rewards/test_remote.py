"""ppoflow.infra.rewards.remote against a real HTTP reward service on 127.0.0.1 (FastAPI +
uvicorn in a process of its own, tests/support/reward_server.py): scores in row order whatever
order the answers arrive in, retries of transient failures, one clear error naming the endpoint
and the rows for everything else, and a bearer token that reaches the service and nothing else.
A service that never answers, or answers HTTP 500 every time, is the standard library's
http.server in a thread (``plain``): the scoring call fails within timeout_s x attempts plus the
backoff (the bound and its arithmetic: the test's docstring), after exactly the attempts set."""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections import Counter

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


#: How long /hang holds a request: far beyond any timeout the tests set.
HANG_S = 10.0


class _Plain(http.server.BaseHTTPRequestHandler):
    """POST /hang: read the request and answer nothing (for HANG_S, then close the connection:
    a scorer without a timeout fails its test in seconds instead of hanging it); /error: HTTP 500."""

    server: _PlainServer

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.server.lock:
            self.server.calls[self.path] += 1
        if self.path == "/hang":
            self.server.stopping.wait(HANG_S)
            return
        body = b'{"detail": "internal error"}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _PlainServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Plain)
        self.lock, self.stopping, self.calls = threading.Lock(), threading.Event(), Counter[str]()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def plain():
    """A service of the standard library's http.server, in a thread of this process: it starts
    at once, and /hang holds every request it accepts (HANG_S, or until the module ends)."""
    server = _PlainServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()
    thread.join(10)


#: What the bound allows beyond the config's own seconds: connecting, the threads' start and
#: scheduling on two busy cores.
SLACK_S = 1.0


def test_a_service_that_never_answers_fails_within_timeout_times_attempts(plain):
    """Bound: a request that gets no answer waits ``timeout_s`` per attempt (httpx's read
    timeout; connecting to a listening socket is immediate), ``retries + 1`` attempts, with the
    backoff's delays between them: retry k waits min(backoff_s * 2**(k-1), backoff_max_s) times a
    jitter in [0.5, 1]. Here timeout_s = 0.2, retries = 2, backoff_s = 0.05:

        at least  3 * 0.2 + 0.5 * (0.05 + 0.10) = 0.675 s
        at most   3 * 0.2 +       (0.05 + 0.10) = 0.75 s,  + SLACK_S (1 s) = 1.75 s

    The requests of one wave (up to ``concurrency`` at once: here both of the two) wait side by
    side, not one after the other; more requests than ``concurrency`` add a wave each."""
    cfg = _cfg(plain.url, "hang", timeout_s=0.2, retries=2, backoff_s=0.05, batch_size=2, concurrency=2)
    attempts = cfg.retries + 1
    backoff = sum(min(cfg.backoff_s * 2 ** (k - 1), cfg.backoff_max_s) for k in range(1, attempts))
    before = plain.calls["/hang"]
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as err:
        score_requests(_requests(["1", "2", "3", "4"]), RemoteScorer(cfg))
    took = time.monotonic() - t0
    assert attempts * cfg.timeout_s + 0.5 * backoff <= took <= attempts * cfg.timeout_s + backoff + SLACK_S
    assert plain.calls["/hang"] - before == 2 * attempts  # both requests, every attempt
    assert str(err.value).startswith(
        f"reward service {plain.url}/hang: no answer within 0.2 s for rows 0..1 (3 attempts); "
    )
    assert "reward.remote.timeout_s" in str(err.value)
    assert not isinstance(err.value, RewardError)  # the task may retry it


def test_http_500_every_time_fails_after_exactly_the_configured_attempts(plain, caplog):
    cfg = _cfg(plain.url, "error", retries=3, backoff_s=0.01)
    before = plain.calls["/error"]
    with caplog.at_level(logging.WARNING, logger="ppoflow.rewards"):
        with pytest.raises(RewardServiceError) as err:
            score_requests(_requests(["1", "2"]), RemoteScorer(cfg))
    assert plain.calls["/error"] - before == cfg.retries + 1 == 4
    assert str(err.value).startswith(
        f"reward service {plain.url}/error: HTTP 500 for rows 0..1 (4 attempts); "
    )
    assert "HTTP 500 for rows 0..1; retry 3 of 3" in caplog.text
    assert not isinstance(err.value, RewardError)


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
