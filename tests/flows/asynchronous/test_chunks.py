"""ppoflow.flows.asynchronous.chunks without ranks: the tokens that end a response, and the seeds of the calls a
batch sampled in chunks makes. The chunk loop itself runs on a producer's engine in
tests/flows/test_asynchronous.py (a straggler's sequences span a weight update)."""

from __future__ import annotations

import json
import types

from ppoflow.flows.asynchronous.chunks import _call_seed, stop_token_ids


def test_stop_tokens_are_the_tokenizers_and_the_generation_configs(tmp_path):
    tokenizer = types.SimpleNamespace(eos_token_id=7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert stop_token_ids(tokenizer, str(tmp_path)) == [5, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert stop_token_ids(tokenizer, str(tmp_path)) == [3, 7]
    assert stop_token_ids(tokenizer, str(tmp_path / "no-model")) == [7]  # no generation config
    assert stop_token_ids(types.SimpleNamespace(eos_token_id=None), str(tmp_path / "no-model")) == []


def test_each_call_of_each_round_has_its_own_repeatable_seed():
    seeds = {(r, c): _call_seed(1234, r, c) for r in range(4) for c in range(3)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds.values())
    assert _call_seed(1234, 2, 1) == seeds[2, 1] and _call_seed(1235, 2, 1) != seeds[2, 1]
