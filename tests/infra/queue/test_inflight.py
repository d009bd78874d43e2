"""ppoflow.infra.queue.inflight: a batch sampled in chunks ends as the engine's one-call rollout of
the same tokens would (columns built by ``ppoflow.workers.rollout.base.assemble_output``, the
engines' own), with each token's version; requeued rows restart from their prompt, at most once
per newer version."""

from __future__ import annotations

import numpy as np
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.queue.inflight import InFlight
from ppoflow.workers.rollout.base import SamplingSettings, assemble_output

EOS, R, CHUNK = 2, 5, 2
#: the full response of each row (row i = sample i % 2 of prompt i // 2): row 1 ends on EOS early
RESPONSES = [[5, 6, 7, 8, 9], [6, EOS], [7, 8, 9, 5, 6], [8, 9, 5, EOS]]


def _prompts() -> DataProto:
    ids = torch.tensor([[0, 0, 11, 12], [0, 13, 14, 15]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        {"uid": np.asarray(["a", "b"], dtype=object)},
        meta_info={"iteration": 3, "seed": 1},
    )


def _engine(flight: InFlight, rows: list[int], budget: int) -> DataProto:
    """What an engine returns for a call: the next ``budget`` tokens of each row's response (its
    log-prob: -token / 100), right-padded. The contexts must be the prompt + the row's tokens."""
    ctx = flight.contexts(rows, {"n": 1, "response_length": budget})
    out_tokens = []
    for j, i in enumerate(rows):
        have = flight.rows[i].tokens
        prompt = _prompts().batch["input_ids"][i // 2]
        assert ctx.batch["input_ids"][j][ctx.batch["attention_mask"][j].bool()].tolist() == [
            *prompt[prompt != 0].tolist(),
            *have,
        ]
        out_tokens.append(RESPONSES[i][len(have) : len(have) + budget])
    resp = torch.zeros((len(rows), budget), dtype=torch.long)
    mask = torch.zeros((len(rows), budget), dtype=torch.long)
    for j, toks in enumerate(out_tokens):
        resp[j, : len(toks)], mask[j, : len(toks)] = torch.tensor(toks), 1
    return DataProto.from_dict(
        {"responses": resp, "response_mask": mask, "rollout_log_probs": -resp.float() / 100}
    )


SAMPLING = {"n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True, "response_length": R}


def test_chunks_across_a_version_change_give_the_one_call_rollout_with_versions():
    flight = InFlight(_prompts(), 2, R, [0, 1, 2, 3], [EOS], SAMPLING)
    version, parts = 4, []
    while flight.unfinished():
        for budget, rows in flight.calls(CHUNK).items():
            flight.absorb(rows, _engine(flight, rows, budget), budget, version)
        version = 5  # a newer policy after the first round: the rows continue under it
        part = flight.take_finished()
        if part is not None:
            parts.append(part)
    got = DataProto.concat(parts)
    got = got[torch.argsort(got.batch["row"])]
    settings = SamplingSettings(n=2, temperature=1.0, top_p=1.0, top_k=-1, response_length=R, do_sample=True)
    lps = [[-t / 100 for t in r] for r in RESPONSES]
    want = assemble_output(_prompts(), RESPONSES, lps, settings, pad_token_id=0, metrics={})
    for key, value in want.batch.items():
        assert torch.equal(got.batch[key], value), key
    assert got.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]
    assert {k: got.meta_info[k] for k in SAMPLING} == SAMPLING and got.meta_info["iteration"] == 3
    versions = got.batch["token_versions"]
    assert versions[0].tolist() == [4, 4, 5, 5, 5] and versions[1].tolist() == [4, 4, -1, -1, -1]
    # published as they finished: row 1 (EOS) in round 1, row 3 (EOS) in round 2, rows 0, 2 in round 3
    assert [p.batch["row"].tolist() for p in parts] == [[1], [3], [0, 2]]


def test_requeue_restarts_unfinished_rows_once_per_newer_version():
    flight = InFlight(_prompts(), 2, R, [0, 2], [EOS], SAMPLING)
    for budget, rows in flight.calls(CHUNK).items():
        flight.absorb(rows, _engine(flight, rows, budget), budget, 4)
    assert flight.requeue(5) == 4  # both rows held 2 tokens of version 4
    assert flight.requeue(5) == 0  # nothing older than 5 left
    while flight.unfinished():
        for budget, rows in flight.calls(CHUNK).items():
            flight.absorb(rows, _engine(flight, rows, budget), budget, 5)
        assert flight.requeue(5) == 0
    assert [state.aborts for state in flight.rows.values()] == [1, 1]
    part = flight.take_finished()
    assert part.batch["token_versions"].unique().tolist() == [5]
    assert part.batch["responses"].tolist() == [RESPONSES[0], RESPONSES[2]]
