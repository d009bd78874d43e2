"""A generative judge as a ppoflow reward service: it speaks ppoflow's reward protocol
(``reward.remote``, docs/tasks.md#a-reward-service) and asks a model served by vLLM's
OpenAI-compatible server (``/v1/chat/completions``) to grade each response against the row's
reference answer.

    vllm serve runs/smollm2/model --served-model-name judge --port 8001 --api-key "$JUDGE_API_KEY"
    JUDGE_BASE_URL=http://127.0.0.1:8001/v1 uvicorn examples.judge.judge_service:app --port 8100

Environment: ``JUDGE_BASE_URL`` (vLLM's ``/v1``), ``JUDGE_MODEL`` (its served name, default
``judge``), ``JUDGE_API_KEY`` (vLLM's ``--api-key``, if any), ``PPOFLOW_REWARD_TOKEN`` (when set,
requests must carry it as their bearer token: ppoflow sends it from the same variable),
``JUDGE_CONCURRENCY`` (chat requests in flight, default 64), ``JUDGE_MAX_TOKENS`` (default 4).

Score: the first digit 0-9 of the judge's reply, divided by 9; a reply without one scores 0 and
is counted in ``judge_unparsed``. A failure of vLLM answers HTTP 502, which ppoflow retries.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request

GRADE = (
    "You grade answers. Question:\n{question}\n\nReference answer: {reference}\n\n"
    "Answer to grade:\n{response}\n\nHow correct is the answer? Reply with one digit from 0 "
    "(wrong) to 9 (right), nothing else."
)
_DIGIT = re.compile(r"[0-9]")

app = FastAPI(title="ppoflow generative judge")
_client: httpx.AsyncClient | None = None
_slots: asyncio.Semaphore | None = None


def _question(prompt: Any) -> str:
    """The last user message of a chat prompt (or the prompt as it is)."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return users[-1] if users else ""
    return str(prompt or "")


async def _grade(row: dict[str, Any]) -> dict[str, float]:
    global _client, _slots
    if _client is None or _slots is None:
        key = os.environ.get("JUDGE_API_KEY")
        _client = httpx.AsyncClient(
            base_url=os.environ["JUDGE_BASE_URL"].rstrip("/"),
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=120.0,
        )
        _slots = asyncio.Semaphore(int(os.environ.get("JUDGE_CONCURRENCY", "64")))
    content = GRADE.format(
        question=_question(row.get("prompt")), reference=row.get("ground_truth"), response=row["response"]
    )
    body = {
        "model": os.environ.get("JUDGE_MODEL", "judge"),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": int(os.environ.get("JUDGE_MAX_TOKENS", "4")),
        "temperature": 0.0,
    }
    async with _slots:
        try:
            resp = await _client.post("/chat/completions", json=body)
            resp.raise_for_status()
            reply = resp.json()["choices"][0]["message"]["content"] or ""
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise HTTPException(502, f"the judge model failed: {type(exc).__name__}: {exc}") from exc
    digit = _DIGIT.search(reply)
    return {"score": int(digit.group()) / 9 if digit else 0.0, "judge_unparsed": float(digit is None)}


@app.post("/score")
async def score(request: Request) -> dict[str, Any]:
    token = os.environ.get("PPOFLOW_REWARD_TOKEN")
    if token and request.headers.get("authorization") != f"Bearer {token}":
        raise HTTPException(401, "a bearer token is required")
    rows = (await request.json())["requests"]
    return {"scores": list(await asyncio.gather(*(_grade(r) for r in rows)))}
