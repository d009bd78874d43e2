"""The format warm start (supervised fine-tuning of the demo's tiny model)."""

from __future__ import annotations

import pytest

from ppoflow.demo.sft import SFTConfig
from ppoflow.infra.data import storage


def test_sft_teaches_the_format_and_publishes_a_hf_directory(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.demo.sft import SUMMARY_FILE, sft
    from ppoflow.demo.tiny_models import save_tiny_model

    base = save_tiny_model(str(tmp_path / "base"), hidden_size=64, num_layers=1, num_heads=2)
    examples = [([{"role": "user", "content": f"{i}+0="}], str(i)) for i in range(10)]
    summary = sft(
        base, str(tmp_path / "sft"), examples, SFTConfig(steps=40, batch_size=10, lr=3e-3), log=None
    )
    assert summary["loss_last"] < summary["loss_first"] / 2
    assert storage.read_json(str(tmp_path / "sft" / SUMMARY_FILE))["examples"] == 10
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "sft"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "sft"))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "3+0="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out[0, -1].item() == tok.eos_token_id or tok.eos_token_id in out[0].tolist()
    with pytest.raises(FileExistsError):
        sft(base, str(tmp_path / "sft"), examples, SFTConfig(steps=1), log=None)
    assert torch.is_tensor(out)
