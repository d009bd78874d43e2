"""``algorithm.filter_overlong_responses`` on multi-turn episodes: an episode cut at the budget
is flagged whether the budget filled with the policy's tokens, with the environment's, or ended
the episode before its next turn fitted (the rollout's ``budget_ended``)."""

from __future__ import annotations

import torch

from ppoflow.algos import truncated_rows
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.tasks.advantage import overlong_rows

R, P = 8, 2


def _batch(spans: list[list[tuple[int, bool]]], budget_ended: list[int] | None) -> DataProto:
    """Rows of (length, policy?) spans after a 2-token prompt."""
    B = len(spans)
    mask, attn = torch.zeros((B, R), dtype=torch.long), torch.zeros((B, P + R), dtype=torch.long)
    attn[:, :P] = 1
    for b, row in enumerate(spans):
        pos = 0
        for length, policy in row:
            mask[b, pos : pos + length] = int(policy)
            attn[b, P + pos : P + pos + length] = 1
            pos += length
    tensors = {
        "responses": torch.ones((B, R), dtype=torch.long),
        "attention_mask": attn,
        "response_mask": mask,
    }
    if budget_ended is not None:
        tensors["budget_ended"] = torch.tensor(budget_ended)
    return DataProto.from_dict(tensors)


def test_episodes_cut_at_the_budget_are_flagged_whoever_filled_it():
    rows = [
        [(3, True), (3, False), (2, True)],  # 8 of 8 tokens, 5 of them the policy's: cut
        [(2, True), (2, False), (1, True)],  # 5 tokens, the next environment answer did not fit
        [(2, True), (2, False), (1, True)],  # 5 tokens, the environment said done
        [(8, True)],  # single-turn shape: the policy filled the budget
        [(0, True)],  # empty
    ]
    batch = _batch(rows, budget_ended=[1, 1, 0, 0, 0])
    assert overlong_rows(batch, R).tolist() == [True, True, False, True, False]
    # the policy's tokens alone (the filter before) miss both multi-turn cuts
    assert truncated_rows(batch.batch["response_mask"], R).tolist() == [False, False, False, True, False]


def test_single_turn_rows_are_flagged_as_before():
    batch = _batch([[(8, True)], [(7, True)], [(1, True)]], budget_ended=None)
    assert overlong_rows(batch, R).tolist() == truncated_rows(batch.batch["response_mask"], R).tolist()
    assert overlong_rows(batch, R).tolist() == [True, False, False]


def test_a_multi_turn_rollout_says_which_episodes_the_budget_ended():
    from ppoflow.workers.rollout.base import SamplingSettings
    from ppoflow.workers.rollout.episodes import Episode, assemble

    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[5, 6]]), "attention_mask": torch.ones((1, 2), dtype=torch.long)}
    )
    settings = SamplingSettings(n=3, temperature=1.0, top_p=1.0, top_k=-1, response_length=R, do_sample=True)
    episodes = []
    for ended in ("budget", "done", "turn_limit"):
        ep = Episode(env=None, schemas=[], prompt=[5, 6], turns=1, done=True, ended_by=ended)  # type: ignore[arg-type]
        ep.add([7, 8], True)
        episodes.append(ep)
    out = assemble(prompts, episodes, settings, {}, pad_token_id=0, log_probs=False)
    assert out.batch["budget_ended"].tolist() == [1, 0, 0]
    assert overlong_rows(out, R).tolist() == [True, False, False]
