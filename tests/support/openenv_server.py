"""An OpenEnv environment for the tests, served by OpenEnv's own server (``create_fastapi_app``
under uvicorn, on 127.0.0.1, in a process of its own: :func:`serve`).

``GuessEnv``: reset(target=...) hides a digit; each step's action ``{"message": text}`` is a guess:
the first digit in the text. Right: reward 1 and done; wrong: reward -0.1 and the observation
``{"hint": "higher" | "lower" | "no digit", "tries": n}``. Every reset and step is recorded, and
``GET /log`` returns the records: ``[episode, kind, what was received, reward, done]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

LOG: list[list[Any]] = []


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    hint: str = ""
    tries: int = 0


class GuessEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, target: int = 0, **kw: Any):
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self.target = int(target)
        LOG.append([self._state.episode_id, "reset", {"seed": seed, "target": target}, None, False])
        return GuessObservation(hint="guess a digit", tries=0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any):
        self._state.step_count += 1
        digits = [int(c) for c in action.message if c.isdigit()]
        if digits and digits[0] == self.target:
            obs = GuessObservation(hint="right", tries=self._state.step_count, done=True, reward=1.0)
        else:
            hint = "no digit" if not digits else ("higher" if digits[0] < self.target else "lower")
            obs = GuessObservation(hint=hint, tries=self._state.step_count, done=False, reward=-0.1)
        LOG.append([self._state.episode_id, "step", action.message, obs.reward, obs.done])
        return obs

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=32)


@app.get("/log")
def log() -> list[list[Any]]:
    return LOG


@contextmanager
def serve(port: int) -> Iterator[str]:
    """Run the app on 127.0.0.1:``port`` in a process of its own; yields its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.support.openenv_server:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        env={**os.environ, "ENABLE_WEB_INTERFACE": "false"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not start on {url}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def records(url: str) -> list[list[Any]]:
    return httpx.get(f"{url}/log", timeout=5.0).json()
