"""The model matrix as data (ppoflow.infra.architectures.matrix): one row per architecture the
brief of docs/models.md lists, each row's claims consistent with the others, and the matrix, the
config check and docs/models.md naming the same architectures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from ppoflow.infra.architectures import ARCHITECTURES, Settings, architecture_of, config_problems, names
from tests.support.paths import ROOT

#: The families users bring (docs/models.md): each must be a row.
EXPECTED = {
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "llama",
    "gemma3_text",
    "mistral",
    "phi3",
    "olmo2",
    "gpt_oss",
    "qwen3_next",
}


def test_every_expected_family_is_a_row_and_rows_are_consistent():
    assert set(names()) == EXPECTED and len(names()) == len(set(names()))
    for row in ARCHITECTURES:
        assert architecture_of(row.name) is row and row.model_type == row.name
        assert row.sequence_parallel <= row.packing, f"{row.name}: sequence parallelism splits packed rows"
        assert row.cpu_engine in ("vllm", "hf") and row.cpu_engine_dtype in ("float32", "bfloat16")
        assert row.real and row.real_name and row.seams
    moe = {row.name for row in ARCHITECTURES if row.moe}
    assert moe == {"qwen3_moe", "gpt_oss", "qwen3_next"}
    assert {row.tied for row in ARCHITECTURES} == {True, False}  # tied and untied heads both covered
    assert architecture_of("no_such_model") is None and architecture_of(None) is None


def test_the_matrix_module_imports_without_torch():
    code = "import sys, ppoflow.infra.architectures; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def _doc_rows() -> list[str]:
    """The ``model_type`` column of docs/models.md's matrix table (second cell, in backticks)."""
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        text = f.read()
    table = text.split("## The matrix", 1)[1].split("\n## ", 1)[0]
    found = [m.group(1) for m in re.finditer(r"^\|[^|\n]+\|\s*`([a-z0-9_]+)`\s*\|", table, re.M)]
    return [name for name in found if name != "model_type"]  # the header


def test_the_matrix_the_config_check_and_the_docs_name_the_same_architectures():
    assert _doc_rows() == names()
    for row in ARCHITECTURES:  # the check knows every row: no note, nothing refused by default (GPU)
        assert config_problems({"model_type": row.name}, Settings(device="cuda")) == ([], [])
    _, notes = config_problems({"model_type": "granite"}, Settings())
    assert all(name in notes[0] for name in names())
