"""ppoflow.infra.rewards.rollout_batch: a rollout batch decoded (prompts, responses, whole episodes),
scored (by the reward of each row, or by the environment for multi-turn episodes), and a score
placed on each row's last response token, against plain loops over the rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.rewards.registry import BatchScorer
from ppoflow.infra.rewards.rollout_batch import (
    decode_episodes,
    decode_prompts,
    decode_responses,
    episode_scores,
    last_response_token,
    on_last_token,
    outcome_scores,
    outcome_texts,
    response_scores,
    rule_scores,
)

P, R = 4, 10


@pytest.fixture(scope="module")
def tok():
    from ppoflow.demo.tiny_models import build_char_tokenizer

    return build_char_tokenizer()


def _batch(tok, prompts: list[str], responses: list[str], **non_tensors) -> DataProto:
    """Left-padded prompts and right-padded responses, as a rollout holds them; an end-of-text
    token after each response (a special token: decoding drops it)."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    pad, eos = tok.pad_token_id, tok.eos_token_id
    p = torch.full((len(prompts), P), pad)
    r = torch.full((len(prompts), R), pad)
    attn = torch.zeros((len(prompts), P + R), dtype=torch.long)
    mask = torch.zeros((len(prompts), R), dtype=torch.long)
    for i, (q, a) in enumerate(zip(prompts, responses)):
        qi, ai = enc(q), [*enc(a), eos]
        p[i, P - len(qi) :] = torch.tensor(qi)
        r[i, : len(ai)] = torch.tensor(ai)
        attn[i, P - len(qi) : P + len(ai)] = 1
        mask[i, : len(ai)] = 1
    tensors = {"prompts": p, "responses": r, "attention_mask": attn, "response_mask": mask}
    return DataProto.from_dict(tensors, {k: np.array(v, dtype=object) for k, v in non_tensors.items()})


def _episodes(tok) -> DataProto:
    """Two multi-turn episodes: policy "ab", environment "<|user|>x<|assistant|>", policy "c";
    and policy "d" alone. The environment's rewards sit on each turn's last token."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    batch = _batch(tok, ["q?", "r?"], ["", ""], data_source=["gsm8k"] * 2, ground_truth=["1", "2"])
    turns = [(enc("ab"), enc("<|user|>x<|assistant|>"), enc("c")), (enc("d"), [], [])]
    batch.batch["responses"][:] = tok.pad_token_id
    batch.batch["response_mask"][:] = 0
    batch.batch["attention_mask"][:, P:] = 0
    env_scores = torch.zeros((2, R))
    for b, (first, env, second) in enumerate(turns):
        toks = first + env + second
        batch.batch["responses"][b, : len(toks)] = torch.tensor(toks)
        batch.batch["attention_mask"][b, P : P + len(toks)] = 1
        batch.batch["response_mask"][b, : len(first)] = 1
        batch.batch["response_mask"][b, len(first) + len(env) : len(toks)] = 1
        env_scores[b, len(first) - 1] += 0.25
        env_scores[b, len(toks) - 1] += 1.0 + b
    batch.batch["env_scores"] = env_scores
    return batch


def test_decoding_prompts_responses_and_episodes(tok):
    batch = _batch(tok, ["1+2=", "9"], ["#### 3", ""])
    assert decode_prompts(batch, tok) == ["1+2=", "9"]
    assert decode_responses(batch, tok) == ["#### 3", ""]
    assert outcome_texts(batch, tok) == ["#### 3", ""]
    # the reward model decodes with the mask it has: the response part of the attention mask
    assert decode_responses(batch, tok, batch.batch["attention_mask"][:, -R:]) == ["#### 3", ""]
    episodes = _episodes(tok)
    assert decode_responses(episodes, tok) == ["abc", "d"]  # the policy's turns
    assert decode_episodes(episodes, tok) == ["ab<|user|>x<|assistant|>c", "d"]
    assert outcome_texts(episodes, tok) == decode_episodes(episodes, tok)


def test_a_score_lands_on_the_last_response_token():
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand((6, 7), generator=gen) < 0.5).long()  # gaps, as multi-turn masks have
    mask[0] = 0  # an empty response
    mask[1] = 1
    values = torch.arange(1.0, 7.0)
    want = torch.zeros((6, 7))
    for b, row in enumerate(mask.tolist()):  # the plain loop: the last 1, position 0 when none
        want[b, max((t for t, m in enumerate(row) if m), default=0)] = values[b]
    assert last_response_token(mask).tolist() == [int(w.nonzero()[0]) for w in want]
    placed = on_last_token(values.double(), mask)
    assert placed.dtype == torch.float32 and torch.equal(placed, want)
    assert on_last_token(torch.ones(2), torch.zeros((2, 0))).shape == (2, 0)
    assert on_last_token(torch.ones(0), torch.zeros((0, 3))).shape == (0, 3)


class Seen(BatchScorer):
    def __init__(self):
        self.requests = []

    def score(self, requests):
        self.requests += requests
        return [float(len(r.response)) for r in requests]


def test_responses_are_scored_with_their_rows(tok):
    batch = _batch(
        tok,
        ["1+2=", "2+2="],
        ["#### 3", "#### 5"],
        data_source=["openai/gsm8k", "gsm8k"],
        ground_truth=["3", "4"],
        extra_info=[{"format_score": 0.0}, {"format_score": 0.1}],
        raw_prompt=["1+2=", "2+2="],
    )
    texts = decode_responses(batch, tok)
    assert response_scores(batch, texts) == pytest.approx([1.0, 0.1])
    scores = rule_scores(batch, tok)
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx([1.0, 0.1])
    seen = Seen()
    assert outcome_scores(batch, tok, seen) == [6.0, 6.0]
    row = seen.requests[1]
    assert (row.data_source, row.response, row.ground_truth, row.prompt) == ("gsm8k", "#### 5", "4", "2+2=")
    assert row.extra_info == {"format_score": 0.1}
    assert outcome_scores(batch, tok, "tests.support.rewards:digit_share", texts=["12", "ab"]) == [1.0, 0.0]


def test_multi_turn_episodes_are_scored_by_their_environment_only(tok):
    episodes = _episodes(tok)
    assert episode_scores(episodes) == [1.25, 2.25]
    # the GSM8K rule would score these 0, and this reward raises: neither is applied
    assert outcome_scores(episodes, tok, "tests.support.rewards:raises_key_error") == [1.25, 2.25]
