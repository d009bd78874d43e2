"""How the flow's tasks read a multi-turn rollout: the environment's rewards are the scores
(training, evaluation), the rule is not applied again, a score lands on the last policy token
of a mask with gaps, and tables show whole episodes."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto
from tests.support.configs import make_config


def _episodes(tokenizer) -> DataProto:
    """Two episodes after a 2-token prompt: policy "ab", environment "<|user|>x<|assistant|>",
    policy "c" (row 0); policy "d" only (row 1)."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rows = [
        (enc("ab"), enc("<|user|>x<|assistant|>"), enc("c")),
        (enc("d"), [], []),
    ]
    R, P = 12, 2
    responses = torch.ones((2, R), dtype=torch.long)
    mask, attn, turns = (
        torch.zeros((2, R), dtype=torch.long),
        torch.zeros((2, R + P), dtype=torch.long),
        torch.full((2, R), -1),
    )
    scores = torch.zeros((2, R))
    for b, (first, env, second) in enumerate(rows):
        toks = first + env + second
        responses[b, : len(toks)] = torch.tensor(toks)
        attn[b, : P + len(toks)] = 1
        mask[b, : len(first)] = 1
        mask[b, len(first) + len(env) : len(toks)] = 1
        turns[b, : len(first) + len(env)] = 0
        turns[b, len(first) + len(env) : len(toks)] = 1
        scores[b, len(toks) - 1] = 1.0 + b
        scores[b, len(first) - 1] += 0.25
    prompts = torch.tensor([enc("q?"), enc("r?")])
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "response_mask": mask,
            "turn_ids": turns,
            "env_scores": scores,
            "num_turns": torch.tensor([2, 1]),
        },
        {
            "data_source": np.array(["openai/gsm8k"] * 2, dtype=object),
            "ground_truth": np.array(["1", "2"], dtype=object),
            "raw_prompt": np.array(["q?", "r?"], dtype=object),
            "uid": np.array(["u0", "u1"], dtype=object),
        },
    )


def test_multi_turn_scores_and_episode_text(tmp_path):
    from ppoflow.demo.tiny_models import build_char_tokenizer
    from ppoflow.infra.rewards.rollout_batch import decode_episodes, last_response_token
    from ppoflow.tasks.advantage import _token_level_scores
    from ppoflow.tasks.evaluate import score_responses

    tok = build_char_tokenizer()
    batch = _episodes(tok)
    cfg = make_config(tmp_path, "m", ["x.parquet"], **{"reward.reward_model.enable": False})
    assert cfg.reward.rule  # the GSM8K rule would score these "responses" 0: it must not be applied
    scores = _token_level_scores(cfg, batch, tok)
    assert torch.equal(scores, batch.batch["env_scores"])
    mask = batch.batch["response_mask"]
    assert last_response_token(mask).tolist() == [max(i for i, m in enumerate(r) if m) for r in mask.tolist()]
    assert last_response_token(torch.zeros((1, 4))).tolist() == [0]
    assert decode_episodes(batch, tok) == ["ab<|user|>x<|assistant|>c", "d"]
    table, metrics = score_responses(
        cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"n": 1})}), batch, tok
    )
    assert table.non_tensor_batch["score"].tolist() == [1.25, 2.25]  # per-turn 0.25 + the episode's
    assert table.non_tensor_batch["response"].tolist() == ["ab<|user|>x<|assistant|>c", "d"]
    assert metrics["val/score"] == 1.75
