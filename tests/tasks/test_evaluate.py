"""ppoflow.tasks.evaluate: which iterations training evaluates; what an evaluation's result depends
on (``spec.json``): ``ppoflow eval`` returns an evaluation already on storage only when it was made
the same way, so every setting that changes the responses must be in the spec; the engine holds an
evaluation's responses when they are longer than training's; ``ppoflow eval`` prints how its
responses were made."""

from __future__ import annotations

import copy

import pytest

from ppoflow.infra.config import apply_overrides, parse_config
from ppoflow.infra.data import storage
from ppoflow.tasks.evaluate import decoding_summary, due, evaluation_spec, finished_evaluation

BASE = {
    "model": {"path": "m"},
    "data": {"train_files": ["d.parquet"], "val_files": ["v.parquet"], "train_batch_size": 4},
    "rollout": {"prompt_length": 64, "response_length": 32},
    "actor": {"ppo_mini_batch_size": 4},
    "critic": {"ppo_mini_batch_size": 4},
}


def _cfg(**over):
    return parse_config(apply_overrides(copy.deepcopy(BASE), over), source="evaluate test")


def test_every_kth_iteration_and_the_last_of_a_run_with_held_out_files():
    cfg = _cfg(**{"evaluation.every": 3, "evaluation.at_end": True})
    assert [n for n in range(1, 10) if due(cfg, n, last_of_run=False)] == [3, 6, 9]
    assert due(cfg, 4, last_of_run=True)
    cfg = _cfg(**{"evaluation.every": 0, "evaluation.at_end": False})
    assert not any(due(cfg, n, last_of_run=n == 5) for n in range(1, 6))
    no_files = _cfg(**{"data.val_files": [], "evaluation.every": 1})
    assert not due(no_files, 1, last_of_run=True)


@pytest.mark.parametrize(
    "setting",
    [
        {"rollout.dtype": "bfloat16"},  # greedy answers change with the engine's dtype
        {"model.dtype": "bfloat16"},  # the engine's dtype when rollout.dtype is not set
        {"rollout.tensor_model_parallel_size": 2},
        {"data.apply_chat_template": False},
        {"data.truncation": "right"},
        {"data.prompt_key": "question"},
        {"model.tokenizer_path": "other-tokenizer"},
        {"evaluation.response_length": 64},
        {"rollout.prompt_length": 128},
    ],
    ids=lambda s: next(iter(s)),
)
def test_a_setting_that_changes_the_responses_is_a_new_evaluation(tmp_path, setting):
    out_dir = str(tmp_path / "eval")
    made = evaluation_spec(_cfg(), "checkpoints/actor/000002", ["v.parquet"])
    storage.write_json_atomic(storage.join(out_dir, "metrics.json"), {"val/score": 0.5})
    storage.write_json_atomic(storage.join(out_dir, "spec.json"), made)
    assert finished_evaluation(out_dir, evaluation_spec(_cfg(), "checkpoints/actor/000002", ["v.parquet"]))
    changed = evaluation_spec(_cfg(**setting), "checkpoints/actor/000002", ["v.parquet"])
    assert finished_evaluation(out_dir, changed) is None


def test_the_engine_holds_an_evaluations_longer_responses():
    assert _cfg().engine_max_model_len() == 64 + 32
    assert _cfg(**{"evaluation.response_length": 16}).engine_max_model_len() == 64 + 32
    assert _cfg(**{"evaluation.response_length": 100}).engine_max_model_len() == 64 + 100


def test_the_decoding_summary_says_what_another_program_must_match():
    assert decoding_summary(_cfg()) == (
        "vllm in float32, greedy, up to 32 new tokens, prompts through the tokenizer's chat template"
    )
    other = _cfg(
        **{
            "rollout.dtype": "bfloat16",
            "evaluation.response_length": 64,
            "evaluation.temperature": 0.7,
            "data.apply_chat_template": False,
        }
    )
    assert decoding_summary(other) == (
        "vllm in bfloat16, temperature 0.7, seed 0, up to 64 new tokens, prompts through plain text (no chat template)"
    )
