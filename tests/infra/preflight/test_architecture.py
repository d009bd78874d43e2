"""The preflight's check of a model's architecture against the model matrix
(ppoflow.infra.preflight.architecture): a config that cannot run is refused by ``preflight()``
before anything starts, naming the field and the fix; a model outside the matrix passes with a note."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ppoflow.infra.preflight import PreflightError, preflight
from ppoflow.infra.preflight.architecture import run_settings
from tests.support.configs import make_config, tokenizer_of


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("arch") / "train.parquet")
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1+2="}],
        "reward_model": {"ground_truth": "3", "style": "rule"},
    }
    pq.write_table(pa.Table.from_pylist([row] * 8), path)
    return path


def _model(tmp_path, arch: str, **edit) -> str:
    from ppoflow.demo.tiny_models import save_tiny_model

    path = save_tiny_model(str(tmp_path / arch), arch=arch)
    if edit:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.update(edit)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


def test_a_hybrid_model_with_packing_is_refused_before_anything_starts(tmp_path, data):
    model = _model(tmp_path, "qwen3_next")
    cfg = make_config(tmp_path, model, [data], **{"actor.use_dynamic_bsz": True, "rollout.dtype": "bfloat16"})
    assert run_settings(cfg, "policy").packing and run_settings(cfg, "critic").packing  # the critic's follows
    with pytest.raises(PreflightError) as err:
        preflight(cfg, lambda: tokenizer_of(model))
    text = str(err.value)
    assert f"model.path={model}: its linear_attention layers take no sequence boundaries" in text
    assert "does not support packed micro-batches" in text
    assert "Fix: set actor.use_dynamic_bsz, ref.log_prob_use_dynamic_bsz and critic.use_dynamic_bsz" in text
    assert "model.path (the critic's)=" in text  # the critic is the same model and packs too
    cfg = make_config(tmp_path, model, [data], **{"actor.use_dynamic_bsz": False, "rollout.dtype": "float32"})
    with pytest.raises(
        PreflightError, match="runs Qwen3-Next .* in bfloat16 only.*Fix: set rollout.dtype: bfloat16"
    ):
        preflight(cfg, lambda: tokenizer_of(model))


def test_a_row_passes_and_a_model_outside_the_matrix_passes_with_a_note(tmp_path, data):
    model = _model(tmp_path, "gemma3_text")
    cfg = make_config(tmp_path, model, [data], **{"actor.use_dynamic_bsz": True})
    report = preflight(cfg, lambda: tokenizer_of(model))
    assert "model.path: Gemma 3 (text) (gemma3_text), a row of the model matrix" in report.passed
    assert not [n for n in report.notes if "model matrix" in n]
    other = _model(tmp_path, "llama", model_type="granite", architectures=["GraniteForCausalLM"])
    report = preflight(make_config(tmp_path, other, [data]), lambda: tokenizer_of(other))
    (note,) = [n for n in report.notes if "model matrix" in n]
    assert "model_type 'granite' is not in ppoflow's model matrix (docs/models.md)" in note
    assert "qwen3_next" in note and "mismatch/*" in note
