"""Preflight of ``teacher`` (``ppoflow.infra.preflight.teacher``): a teacher must share the
student's tokenizer. Teachers are built for real on disk: one with the student's tokenizer (and
other weights) passes; one whose tokenizer has a token more is refused before anything starts,
the problem naming both tokenizers and what differs; a teacher directory that does not exist is
named with the model paths' fix."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.infra.preflight import PreflightError, preflight
from ppoflow.infra.preflight.teacher import tokenizer_differences
from tests.support.configs import make_config, tokenizer_of

DISTILL = {"recipe": "distill", "rollout.n": 1}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The student, a teacher with its tokenizer (other weights), and a teacher whose tokenizer
    has one special token more (ids of the others unchanged: only a comparison finds it)."""
    from ppoflow.demo.tiny_models import build_char_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("teachers")
    student = save_tiny_model(str(root / "student"), seed=0)
    same = save_tiny_model(str(root / "teacher"), seed=1)
    other = save_tiny_model(str(root / "other"), seed=2)
    tok = build_char_tokenizer()
    tok.add_tokens(["<|tool|>"], special_tokens=True)
    tok.save_pretrained(other)
    return {"student": student, "same": same, "other": other, "data": _data(root / "train.parquet")}


def _data(path) -> str:
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+1="}],
            "reward_model": {"ground_truth": str(i + 1), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _config(tmp_path, models, teacher: str):
    return make_config(
        tmp_path, models["student"], [models["data"]], **DISTILL, **{"teacher.model.path": teacher}
    )


def test_a_teacher_with_the_students_tokenizer_passes(tmp_path, models):
    report = preflight(_config(tmp_path, models, models["same"]), lambda: tokenizer_of(models["student"]))
    assert f"teacher: {models['same']} shares the student's tokenizer" in report.passed
    assert f"teacher.model.path: {models['same']}" in report.passed


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, models):
    cfg = _config(tmp_path, models, models["other"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(models["student"]))
    [problem] = err.value.problems
    assert problem.where == f"teacher.model.path={models['other']}"
    assert f"the teacher's tokenizer ({models['other']}) is not the student's ({models['student']})" in (
        problem.found
    )
    assert "vocabularies differ: 261 tokens vs 262; 1 only the teacher's (e.g. '<|tool|>')" in problem.found
    assert "special tokens differ" in problem.found and "same tokenizer" in problem.fix
    assert not os.path.exists(tmp_path / "runs" / "exp" / "manifest.json")  # nothing started


def test_a_missing_teacher_directory_is_a_model_path_problem(tmp_path, models):
    missing = str(tmp_path / "no-teacher")
    with pytest.raises(PreflightError) as err:
        preflight(_config(tmp_path, models, missing), lambda: tokenizer_of(models["student"]))
    wheres = [p.where for p in err.value.problems]
    assert f"teacher.model.path={missing}" in wheres
    assert any("no such directory" in p.found for p in err.value.problems)


def test_tokenizer_differences_names_moved_ids_and_special_token_ids(models):
    from ppoflow.demo.tiny_models import SPECIAL_TOKENS, build_char_tokenizer

    student = tokenizer_of(models["student"])
    assert tokenizer_differences(student, tokenizer_of(models["same"])) == []
    swapped = build_char_tokenizer()
    vocab = swapped.get_vocab()
    a, b = vocab["<|endoftext|>"], vocab["<|pad|>"]
    from transformers import Qwen2Tokenizer

    vocab["<|endoftext|>"], vocab["<|pad|>"] = b, a  # the same tokens, eos and pad trade ids
    moved = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    found = tokenizer_differences(student, moved)
    assert (
        found[0]
        == "vocabularies differ: 261 tokens vs 261; 2 with other ids (e.g. '<|endoftext|>', '<|pad|>')"
    )
    assert f"eos token id {a} vs {b}" in found and f"pad token id {b} vs {a}" in found
