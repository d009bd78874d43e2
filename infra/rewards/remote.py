"""A reward service over HTTP (``reward.remote``): :class:`RemoteScorer`, a :class:`BatchScorer`
that posts the rows to score and reads their scores.

    POST <endpoint>   {"requests": [{"data_source", "prompt", "response", "ground_truth",
                                     "extra_info"}, ...]}            (batch_size rows a request)
    200               {"scores": [0.5, {"score": 1.0, "judge_tokens": 12}, ...]}  (one per row, in order)

Requests go out ``concurrency`` at a time; the scores come back in row order whatever order the
answers arrive in. A transient failure (no connection, no answer within ``timeout_s``, HTTP 5xx
or 429, a body that is not the JSON above) is retried ``retries`` times with a doubling delay
(``backoff_s`` up to ``backoff_max_s``). Then:

- the service cannot be reached, or keeps failing: :class:`RewardServiceError`, which the task
  retries (the iteration fails after that, and commits nothing);
- the service answers, but not with scores (malformed JSON every time, HTTP 4xx, a wrong number
  of scores, a score that is not a number): :class:`~ppoflow.infra.rewards.RewardError`, naming
  the endpoint and the rows; a retry of the task would get the same answer, so it fails at once.

Credentials: a bearer token from the environment variable ``token_env`` or the Prefect Secret
block ``token_secret``, read when the scorer is built and kept in memory only (never in the
config, a log line, an error or an artifact); TLS with ``ca_bundle`` and ``client_cert``.

    reward = run_reward(cfg.reward)   # the reward every row gets: the service, custom_function or None
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx

from ppoflow.infra.rewards.registry import BatchScorer, Reward, RewardError, ScoreRequest

if TYPE_CHECKING:
    from ppoflow.infra.config.models import RewardConfig
    from ppoflow.infra.config.remote_reward import RemoteRewardConfig

__all__ = ["RemoteScorer", "RewardServiceError", "run_reward", "remote_scorer"]

_LOG = logging.getLogger("ppoflow.rewards")
_TRANSIENT_STATUS = {429, 500, 502, 503, 504}


class RewardServiceError(RuntimeError):
    """The reward service could not be reached, or failed every retry: a later retry may work."""


class _Retry(Exception):
    """A transient failure of one request: an HTTP 5xx/429, or (``malformed``) an answer that is
    not ``{"scores": [...]}`` JSON, which ends in a RewardError once the retries are spent."""

    def __init__(self, what: str, malformed: bool = False):
        super().__init__(what)
        self.malformed = malformed


def _token(cfg: RemoteRewardConfig) -> str | None:
    """The bearer token: from ``token_env``, else from the Prefect Secret block ``token_secret``."""
    token = os.environ.get(cfg.token_env) if cfg.token_env else None
    if token:
        return token
    if not cfg.token_secret:
        return None
    from prefect.blocks.system import Secret

    try:
        secret: Any = Secret.load(cfg.token_secret)  # typed sync-or-async; called sync here
    except ValueError as exc:
        raise RewardError(
            f"reward.remote.token_secret={cfg.token_secret!r}: no such Prefect Secret block ({exc}); "
            f"create it (prefect.blocks.system.Secret(value=...).save({cfg.token_secret!r})) or set "
            f"${cfg.token_env or 'PPOFLOW_REWARD_TOKEN'}"
        ) from None
    return str(secret.get())


class RemoteScorer(BatchScorer):
    """Scores rows with the service of a ``reward.remote`` config (see the module docstring)."""

    def __init__(self, cfg: RemoteRewardConfig):
        self.cfg = cfg
        headers = {"Content-Type": "application/json"}
        token = _token(cfg)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify: Any = cfg.ca_bundle or cfg.verify_tls
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s),
            verify=verify,
            cert=cfg.client_cert,
            follow_redirects=False,
        )

    @property
    def name(self) -> str:
        return f"reward service {self.cfg.endpoint}"

    def __repr__(self) -> str:  # no headers: they hold the token
        return f"RemoteScorer({self.cfg.endpoint!r})"

    def close(self) -> None:
        self._client.close()

    def score(self, requests: Sequence[ScoreRequest]) -> list[float | dict[str, Any]]:
        """One score per request, in order (requests of ``batch_size`` rows, ``concurrency`` at once)."""
        size = self.cfg.batch_size
        chunks = [(start, requests[start : start + size]) for start in range(0, len(requests), size)]
        if len(chunks) <= 1 or self.cfg.concurrency == 1:
            parts = [self._post(start, chunk) for start, chunk in chunks]
        else:
            with ThreadPoolExecutor(min(self.cfg.concurrency, len(chunks))) as pool:
                parts = list(pool.map(lambda c: self._post(*c), chunks))
        return [score for part in parts for score in part]

    def _rows(self, start: int, n: int) -> str:
        return f"rows {start}..{start + n - 1}" if n > 1 else f"row {start}"

    def _post(self, start: int, chunk: Sequence[ScoreRequest]) -> list[Any]:
        """The scores of one request, retried (see the module docstring)."""
        cfg, rows = self.cfg, self._rows(start, len(chunk))
        body = json.dumps({"requests": [r.to_json() for r in chunk]}).encode()
        failure = ""
        malformed = False
        for attempt in range(cfg.retries + 1):
            if attempt:
                delay = min(cfg.backoff_s * 2 ** (attempt - 1), cfg.backoff_max_s)
                delay *= 0.5 + random.random() / 2  # jitter: concurrent retries do not stampede
                _LOG.warning(
                    "%s: %s for %s; retry %d of %d in %.1f s",
                    self.name,
                    failure,
                    rows,
                    attempt,
                    cfg.retries,
                    delay,
                )
                time.sleep(delay)
            try:
                return self._answer(self._client.post(cfg.endpoint, content=body), start, chunk)
            except httpx.TimeoutException:
                failure, malformed = f"no answer within {cfg.timeout_s} s", False
            except httpx.TransportError as exc:
                failure, malformed = f"{type(exc).__name__}: {exc}", False
            except _Retry as exc:
                failure, malformed = str(exc), exc.malformed
        tries = f"{cfg.retries + 1} attempt{'s' if cfg.retries else ''}"
        if malformed:
            raise RewardError(
                f"{self.name} answered {rows} with {failure} ({tries}); it must answer "
                '{"scores": [one number, or {"score": number, ...}, per row]}: fix the service'
            )
        raise RewardServiceError(
            f"{self.name}: {failure} for {rows} ({tries}); check that the service is up and answers "
            f"within reward.remote.timeout_s={cfg.timeout_s} s"
        )

    def _answer(self, resp: httpx.Response, start: int, chunk: Sequence[ScoreRequest]) -> list[Any]:
        """The scores in a response, or why there are none."""
        rows = self._rows(start, len(chunk))
        if resp.status_code in _TRANSIENT_STATUS:
            raise _Retry(f"HTTP {resp.status_code}")
        if resp.status_code != 200:
            hint = (
                " (check the bearer token: reward.remote.token_env / token_secret)"
                if resp.status_code in (401, 403)
                else ""
            )
            raise RewardError(
                f"{self.name} refused {rows}: HTTP {resp.status_code} {resp.text[:200]!r}{hint}"
            )
        try:
            scores = resp.json()["scores"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Retry(f"malformed JSON ({type(exc).__name__}: {str(exc)[:120]})", malformed=True) from None
        if not isinstance(scores, list) or len(scores) != len(chunk):
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise RewardError(
                f"{self.name} answered {got} scores for {rows} ({len(chunk)} rows): it must answer one "
                "score per row, in order"
            )
        return scores


@functools.lru_cache(maxsize=8)
def _scorer(config_json: str) -> RemoteScorer:
    from ppoflow.infra.config.remote_reward import RemoteRewardConfig

    return RemoteScorer(RemoteRewardConfig.model_validate_json(config_json))


def remote_scorer(cfg: RemoteRewardConfig) -> RemoteScorer:
    """The process's scorer of ``cfg`` (one connection pool per config)."""
    return _scorer(cfg.model_dump_json())


def run_reward(reward: RewardConfig) -> str | Reward | None:
    """The reward that scores every row of a run: its service (``reward.remote``), its
    ``reward.custom_function``, or None (each row's ``data_source`` picks its rule)."""
    if reward.remote is not None:
        return remote_scorer(reward.remote)
    return reward.custom_function
