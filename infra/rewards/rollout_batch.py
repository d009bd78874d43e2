"""Scoring a rollout batch (a :class:`~ppoflow.infra.data.dataproto.DataProto`): its texts, its
outcome scores, and where a score goes among the tokens.

    texts = outcome_texts(batch, tokenizer)                   # responses, or whole episodes
    scores = outcome_scores(batch, tokenizer, reward, texts)  # one float per row
    token_scores = on_last_token(torch.tensor(scores), batch.batch["response_mask"])  # (B, R)

A single-turn row's outcome is its decoded response (special tokens dropped) scored by
:func:`~ppoflow.infra.rewards.scoring.score_requests` with the row's ``data_source``,
``ground_truth``, ``extra_info`` and ``raw_prompt``. A multi-turn row (an ``env_scores`` column:
the environment scored every turn while the episode ran) is not scored again: its outcome is the
sum of its environment's rewards, its text the whole episode with the turns' special tokens.

A sequence's score sits on its last response token (:func:`last_response_token`): the last 1 of
the mask, the end of a response or of a multi-turn episode's last policy turn (its mask has
gaps), position 0 for an empty one. The ``advantage`` task places rule scores and the overlong
penalty there, the reward-model worker its scores.

Kept out of the package's ``__init__`` (it needs torch and DataProto), so that a module that only
registers a reward imports light.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.rewards.registry import Reward, ScoreRequest
from ppoflow.infra.rewards.scoring import score_requests

__all__ = [
    "is_multi_turn",
    "decode_prompts",
    "decode_responses",
    "decode_episodes",
    "outcome_texts",
    "last_response_token",
    "on_last_token",
    "requests_of",
    "response_scores",
    "rule_scores",
    "episode_scores",
    "outcome_scores",
]

#: The non-tensor columns a score request reads.
ROW_COLUMNS = ("data_source", "ground_truth", "extra_info", "raw_prompt")


def is_multi_turn(batch: DataProto) -> bool:
    """Whether the rows are multi-turn episodes, scored by their environment as they ran."""
    return "env_scores" in batch.batch


def decode_prompts(batch: DataProto, tokenizer: Any) -> list[str]:
    """The text of each row's prompt (its unmasked tokens, special tokens dropped)."""
    prompts = batch.batch["prompts"]
    mask = batch.batch["attention_mask"][:, : prompts.shape[1]].bool()
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(prompts, mask)]


def decode_responses(batch: DataProto, tokenizer: Any, mask: torch.Tensor | None = None) -> list[str]:
    """The text of each response of a rollout: its tokens where ``mask`` (default: the
    ``response_mask``) is 1, special tokens dropped. For a multi-turn row: the policy's turns."""
    responses = batch.batch["responses"]
    keep = (batch.batch["response_mask"] if mask is None else mask).bool()
    return [tokenizer.decode(row[m].tolist(), skip_special_tokens=True) for row, m in zip(responses, keep)]


def decode_episodes(batch: DataProto, tokenizer: Any) -> list[str]:
    """The text of each multi-turn episode after its prompt: the policy's and the environment's
    tokens (the attention mask's response part), special tokens kept (they delimit the turns)."""
    width = batch.batch["responses"].shape[1]
    mask = batch.batch["attention_mask"][:, -width:].bool()
    return [tokenizer.decode(row[m].tolist()) for row, m in zip(batch.batch["responses"], mask)]


def outcome_texts(batch: DataProto, tokenizer: Any) -> list[str]:
    """What people read of each row: the whole episode (multi-turn) or the response."""
    return decode_episodes(batch, tokenizer) if is_multi_turn(batch) else decode_responses(batch, tokenizer)


def last_response_token(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last position where ``mask`` is 1 (0 for an empty row): the end
    of a response, or of a multi-turn episode's last policy turn."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    return (
        torch.where(mask != 0, positions, 0).amax(dim=-1)
        if mask.shape[1]
        else torch.zeros(len(mask), dtype=torch.long)
    )


def on_last_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) float32: each row's value of ``values`` (B,) at its :func:`last_response_token`,
    0 everywhere else."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    if out.numel():
        out[torch.arange(len(mask)), last_response_token(mask)] = values.to(torch.float32)
    return out


def requests_of(batch: DataProto, texts: list[str]) -> list[ScoreRequest]:
    """The score request of each text: the text as the response to its row of ``batch``."""
    nt = batch.non_tensor_batch
    columns = {k: nt[k] for k in ROW_COLUMNS if k in nt}
    return [ScoreRequest.from_row({k: v[i] for k, v in columns.items()}, t) for i, t in enumerate(texts)]


def response_scores(batch: DataProto, texts: list[str], reward: str | Reward | None = None) -> list[float]:
    """The score of each response text of ``batch`` by ``reward`` (an import path, a function or a
    BatchScorer; None: the reward registered for each row's ``data_source``)."""
    scores, _ = score_requests(requests_of(batch, texts), reward)
    return [float(s) for s in scores]


def rule_scores(batch: DataProto, tokenizer: Any, reward: str | Reward | None = None) -> torch.Tensor:
    """(B,) float32 score of each decoded response (see :func:`response_scores`)."""
    scores = response_scores(batch, decode_responses(batch, tokenizer), reward)
    return torch.as_tensor(np.asarray(scores, dtype=np.float32))


def episode_scores(batch: DataProto) -> list[float]:
    """The outcome of each multi-turn episode: the sum of its environment's rewards."""
    return [float(s) for s in batch.batch["env_scores"].sum(-1).tolist()]


def outcome_scores(
    batch: DataProto, tokenizer: Any, reward: str | Reward | None = None, texts: list[str] | None = None
) -> list[float]:
    """The outcome score of each row (see the module docstring): the environment's (multi-turn)
    or the reward's of the decoded response (``texts`` when the caller decoded them already)."""
    if is_multi_turn(batch):
        return episode_scores(batch)
    return response_scores(batch, decode_responses(batch, tokenizer) if texts is None else texts, reward)
