"""A reward service for the tests: a FastAPI app served by uvicorn on 127.0.0.1 in a process of
its own (:func:`serve`), speaking ppoflow's reward protocol (``ppoflow.infra.rewards.remote``).

Routes (POST ``{"requests": [...]}``):
    /score       score = the number of digits in the response / 10 (``{"score", "digits"}`` for
                 rows whose extra_info asks ``{"dict": true}``); takes ``delay`` seconds first when
                 a row's extra_info says ``{"delay": s}`` (answers then arrive out of order)
    /flaky       HTTP 500 on the first request of each batch it sees, then /score
    /stall       never answers within a test's timeout (sleeps 30 s)
    /malformed   a body that is not JSON
    /wrong-count one score fewer than asked
    /nan-text    the score "high" for every row
    /auth        /score when the bearer token is $REWARD_SERVER_TOKEN, else HTTP 401
GET /calls: how many requests each route got, and the batch sizes /score saw.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

app = FastAPI()
CALLS: Counter[str] = Counter()
SIZES: list[int] = []
SEEN: set[str] = set()


def _digits(text: str) -> int:
    return sum(c.isdigit() for c in text)


async def _scores(body: dict[str, Any]) -> list[Any]:
    rows = body["requests"]
    SIZES.append(len(rows))
    delay = max(float((r.get("extra_info") or {}).get("delay", 0)) for r in rows)
    if delay:
        await asyncio.sleep(delay)
    out: list[Any] = []
    for r in rows:
        score = _digits(r["response"]) / 10
        info = r.get("extra_info") or {}
        out.append({"score": score, "digits": _digits(r["response"])} if info.get("dict") else score)
    return out


@app.post("/score")
async def score(request: Request) -> Any:
    CALLS["score"] += 1
    return {"scores": await _scores(await request.json())}


@app.post("/flaky")
async def flaky(request: Request) -> Any:
    CALLS["flaky"] += 1
    body = await request.json()
    key = repr([r["response"] for r in body["requests"]])
    if key not in SEEN:
        SEEN.add(key)
        return JSONResponse({"detail": "overloaded"}, status_code=500)
    return {"scores": await _scores(body)}


@app.post("/stall")
async def stall() -> Any:
    CALLS["stall"] += 1
    await asyncio.sleep(30)
    return {"scores": []}


@app.post("/malformed")
async def malformed() -> Any:
    CALLS["malformed"] += 1
    return PlainTextResponse('{"scores": [1.0, ', media_type="application/json")


@app.post("/wrong-count")
async def wrong_count(request: Request) -> Any:
    CALLS["wrong-count"] += 1
    return {"scores": (await _scores(await request.json()))[:-1]}


@app.post("/nan-text")
async def nan_text(request: Request) -> Any:
    CALLS["nan-text"] += 1
    body = await request.json()
    return {"scores": ["high"] * len(body["requests"])}


@app.post("/auth")
async def auth(request: Request) -> Any:
    CALLS["auth"] += 1
    if request.headers.get("authorization") != f"Bearer {os.environ['REWARD_SERVER_TOKEN']}":
        return JSONResponse({"detail": "bad token"}, status_code=401)
    return {"scores": await _scores(await request.json())}


@app.get("/calls")
async def calls_route() -> Any:
    return {"calls": dict(CALLS), "sizes": SIZES}


@contextmanager
def serve(port: int, token: str = "") -> Iterator[str]:
    """Run the app on 127.0.0.1:``port`` in a process of its own; yields its base URL."""
    env = {**os.environ, "REWARD_SERVER_TOKEN": token}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.support.reward_server:app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/calls", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the reward server did not start on {url}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def calls(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/calls", timeout=5.0).json()
