"""The episodes of multi-turn rollouts: one episode's tokens as they grow (:class:`Episode`), the
rollout rows a batch of them makes (:func:`assemble`, the columns are listed in
``ppoflow.workers.rollout.multiturn``), and their metrics (:func:`episode_metrics`, merged over
data-parallel shards by :data:`EPISODE_METRIC_RULES`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ppoflow.infra.envs import Environment
from ppoflow.infra.remote.rank.worker import MetricRule
from ppoflow.workers.rollout.base import SamplingSettings, _output_meta, _position_ids, prompt_token_lists

__all__ = ["Episode", "assemble", "episode_metrics", "last_turn", "EPISODE_METRIC_RULES"]

#: How :func:`episode_metrics` of equal dp shards make the whole batch's (declared by the worker
#: methods that return a rollout): the largest ``*_max``, the smallest ``*_min``, per-episode counts
#: over all episodes (a shard whose episodes never called a tool reports none: 0 there), a tool's
#: error rate over all its calls; every other metric the mean over the shards.
EPISODE_METRIC_RULES = (
    MetricRule(pattern="*_max", merge="max"),
    MetricRule(pattern="*_min", merge="min"),
    MetricRule(pattern="*_per_episode", merge="mean_or_zero"),
    MetricRule(pattern="*/error_rate", merge="ratio", of=("errors_per_episode", "calls_per_episode")),
)


@dataclass
class Episode:
    """One episode's state: its prompt, its tokens so far (policy and environment), which are the
    policy's, their turn, the rewards by position, its log-probs (0 on environment tokens)."""

    env: Environment
    schemas: list[dict]
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    policy: list[int] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)
    turns: int = 0
    done: bool = False
    ended_by: str = ""
    tool_calls: dict[str, list[int]] = field(default_factory=dict)  # name -> [calls, errors]

    def add(self, toks: list[int], policy: bool, lps: list[float] | None = None) -> None:
        self.tokens += toks
        self.policy += [int(policy)] * len(toks)
        self.turn += [self.turns - 1] * len(toks)  # the environment's answer belongs to the turn before
        self.log_probs += lps if lps is not None else [0.0] * len(toks)


def last_turn(ep: Episode) -> list[int]:
    """The tokens of the episode's last policy turn."""
    start = len(ep.turn)
    while start > 0 and ep.policy[start - 1] and ep.turn[start - 1] == ep.turn[-1]:
        start -= 1
    return ep.tokens[start:]


def assemble(
    prompts,
    episodes: list[Episode],
    s: SamplingSettings,
    metrics: dict[str, float],
    pad_token_id: int,
    log_probs: bool,
):
    """The rollout rows of ``episodes`` (the module docstring of ``multiturn`` lists the columns);
    ``log_probs``: with the engine's ``rollout_log_probs``."""
    from ppoflow.infra.data.dataproto import DataProto

    n, R = s.n, s.response_length
    rows = _episode_rows(episodes, prompts, R, pad_token_id)
    prompt_pos = _prompt_positions(prompts, episodes, rows.prompt_mask, n)
    resp_pos = prompt_pos[:, -1:] + torch.arange(1, R + 1, dtype=prompt_pos.dtype).unsqueeze(0)
    tensors = {
        "prompts": rows.prompt_ids,
        "responses": rows.responses,
        "input_ids": torch.cat([rows.prompt_ids, rows.responses], dim=1),
        "attention_mask": torch.cat([rows.prompt_mask, rows.attention], dim=1),
        "position_ids": torch.cat([prompt_pos, resp_pos], dim=1),
        "response_mask": rows.response_mask,
        "turn_ids": rows.turn_ids,
        "env_scores": rows.env_scores,
        "num_turns": torch.as_tensor([e.turns for e in episodes], dtype=torch.long),
        "budget_ended": torch.as_tensor([e.ended_by == "budget" for e in episodes], dtype=torch.long),
    }
    if log_probs:
        tensors["rollout_log_probs"] = rows.log_probs
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors, non_tensors, _output_meta(prompts, s, metrics))


class _Rows(NamedTuple):
    """A batch of episodes as padded rows (see :func:`_episode_rows`)."""

    prompt_ids: torch.Tensor  # (B, P) left-padded to the input's width
    prompt_mask: torch.Tensor
    responses: torch.Tensor  # (B, R) the episode's tokens, right-padded
    attention: torch.Tensor  # 1 on every episode token
    response_mask: torch.Tensor  # 1 on the policy's tokens
    turn_ids: torch.Tensor  # -1 on padding
    env_scores: torch.Tensor  # each reward at its position
    log_probs: torch.Tensor  # 0 on the environment's tokens


def _episode_rows(episodes: list[Episode], prompts, R: int, pad_token_id: int) -> _Rows:
    """Each episode as one row: its prompt left-padded to the input's width, its tokens (policy
    and environment) right-padded to ``R``, with their masks, turns, rewards and log-probs."""
    width = prompts.batch["input_ids"].shape[1]
    B = len(episodes)
    prompt_ids = torch.full((B, width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((B, width), dtype=prompts.batch["attention_mask"].dtype)
    resp = torch.full((B, R), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, R), dtype=prompt_mask.dtype)
    loss_mask = torch.zeros((B, R), dtype=torch.long)
    turn_ids = torch.full((B, R), -1, dtype=torch.long)
    scores = torch.zeros((B, R), dtype=torch.float32)
    lp = torch.zeros((B, R), dtype=torch.float32)
    for b, ep in enumerate(episodes):
        k, p = len(ep.tokens), len(ep.prompt)
        prompt_ids[b, width - p :] = torch.as_tensor(ep.prompt)
        prompt_mask[b, width - p :] = 1
        if k:
            resp[b, :k] = torch.as_tensor(ep.tokens)
            attn[b, :k] = 1
            loss_mask[b, :k] = torch.as_tensor(ep.policy)
            turn_ids[b, :k] = torch.as_tensor(ep.turn)
            lp[b, :k] = torch.as_tensor(ep.log_probs, dtype=torch.float32)
        for pos, r in ep.rewards.items():
            scores[b, pos] += r
    return _Rows(prompt_ids, prompt_mask, resp, attn, loss_mask, turn_ids, scores, lp)


def _prompt_positions(prompts, episodes: list[Episode], prompt_mask: torch.Tensor, n: int) -> torch.Tensor:
    """The rows' prompt position ids: the input's ``position_ids`` (repeated ``n`` times) when it
    has them and every episode's prompt is the input's own; else counted along ``prompt_mask``
    (the environment's reset rendered another prompt, e.g. with the tools on offer)."""
    given_pos = prompts.batch.get("position_ids")
    if (
        all(
            e.prompt == g
            for e, g in zip(
                episodes[::n],
                prompt_token_lists(prompts.batch["input_ids"], prompts.batch["attention_mask"]),
            )
        )
        and given_pos is not None
    ):
        return _position_ids(prompts, n)
    return (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)


def episode_metrics(
    episodes: list[Episode], generate_s: float, sample_s: float, env_s: float, sampled: int
) -> dict[str, float]:
    """``rollout/*`` episode metrics and ``tool/<name>/calls_per_episode``, ``errors_per_episode``
    and ``error_rate``."""
    n = max(1, len(episodes))
    turns = [e.turns for e in episodes]
    total = [len(e.tokens) for e in episodes]
    policy = [sum(e.policy) for e in episodes]
    out = {
        "rollout/generate_s": generate_s,
        "rollout/sample_s": sample_s,
        "rollout/env_s": env_s,
        "rollout/tokens_per_s": sampled / sample_s if sample_s > 0 else 0.0,
        "rollout/policy_tokens_per_s": sampled / sample_s if sample_s > 0 else 0.0,
        "rollout/turns_mean": sum(turns) / n,
        "rollout/turns_max": float(max(turns, default=0)),
        "rollout/episode_tokens_mean": sum(total) / n,
        "rollout/policy_tokens_mean": sum(policy) / n,
        "rollout/env_tokens_mean": (sum(total) - sum(policy)) / n,
    }
    for why in ("done", "turn_limit", "budget"):
        out[f"rollout/ended_{why}_share"] = sum(e.ended_by == why for e in episodes) / n
    names = sorted({k for e in episodes for k in e.tool_calls})
    for name in names:
        calls = sum(e.tool_calls.get(name, [0, 0])[0] for e in episodes)
        errors = sum(e.tool_calls.get(name, [0, 0])[1] for e in episodes)
        out[f"tool/{name}/calls_per_episode"] = calls / n
        out[f"tool/{name}/errors_per_episode"] = errors / n
        out[f"tool/{name}/error_rate"] = errors / calls if calls else 0.0
    return out
