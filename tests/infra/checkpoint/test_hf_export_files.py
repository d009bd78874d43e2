"""What an exported directory says besides its weights (ppoflow.infra.checkpoint.hf_export): the
tokenizer the run rendered its prompts with (``model.tokenizer_path`` when it is not the base
model's), and the dtype its weights are written in. ``ppoflow eval --model`` of an export, or any
other program, reads both from the directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.checkpoint.hf_export import publish_hf_dir

MESSAGES = [{"role": "user", "content": "max(3,7)="}]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("hf-files") / "base"), seed=0)


def _weights(model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def test_the_export_renders_prompts_with_the_runs_tokenizer(base, tmp_path):
    from transformers import AutoTokenizer

    run_tokenizer = AutoTokenizer.from_pretrained(base)
    run_tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    run_tokenizer.save_pretrained(str(tmp_path / "tokenizer"))
    expected = run_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    base_text = AutoTokenizer.from_pretrained(base).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert expected != base_text

    out = publish_hf_dir(
        _weights(base, torch.float32), str(tmp_path / "out"), base, tokenizer_path=str(tmp_path / "tokenizer")
    )
    exported = AutoTokenizer.from_pretrained(out)
    assert exported.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == expected
    # the base's own tokenizer when the run had no other
    same = publish_hf_dir(_weights(base, torch.float32), str(tmp_path / "same"), base, tokenizer_path=base)
    text = AutoTokenizer.from_pretrained(same).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert text == base_text
    with pytest.raises(FileNotFoundError, match="model.tokenizer_path"):
        publish_hf_dir(_weights(base, torch.float32), str(tmp_path / "x"), base, tokenizer_path="no/such/dir")


def test_config_records_the_dtype_the_weights_are_written_in(base, tmp_path):
    from transformers import AutoModelForCausalLM

    with open(os.path.join(base, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    out = publish_hf_dir(_weights(base, torch.bfloat16), str(tmp_path / "bf16"), base)  # dtype kept
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16
    kept = publish_hf_dir(_weights(base, torch.float32), str(tmp_path / "fp32"), base)
    with open(os.path.join(kept, "config.json")) as f, open(os.path.join(base, "config.json")) as g:
        assert f.read() == g.read()  # the base's file, untouched
