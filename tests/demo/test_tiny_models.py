"""Tiny models built from configs: a byte-level tokenizer with one token per byte, and models that
transformers loads back as saved, the same for the same seed."""

from __future__ import annotations

import pytest
import torch

from ppoflow.demo.tiny_models import (
    build_char_tokenizer,
    save_tiny_model,
    save_tiny_reward_model,
    tiny_config,
)


def test_the_tokenizer_has_one_token_per_byte_after_the_specials(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    text = "max(3,7)= é\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == [5 + b for b in text.encode()]  # bytes 0..255 at ids 5..260
    assert tok.decode(ids) == text and (tok.eos_token_id, tok.pad_token_id) == (0, 1)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|user|>hi<|assistant|>"
    tok.save_pretrained(str(tmp_path))
    assert AutoTokenizer.from_pretrained(str(tmp_path)).encode(text, add_special_tokens=False) == ids


def test_saved_models_load_back_and_depend_only_on_the_seed(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    a = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "a"), seed=3))
    b = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "b"), seed=3))
    c = AutoModelForCausalLM.from_pretrained(save_tiny_model(str(tmp_path / "c"), seed=4))
    assert a.config.vocab_size == len(build_char_tokenizer()) == 261
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(a(ids).logits, b(ids).logits) and not torch.equal(a(ids).logits, c(ids).logits)
    rm = AutoModelForSequenceClassification.from_pretrained(save_tiny_reward_model(str(tmp_path / "rm")))
    assert rm(ids).logits.shape == (1, 1)
    with pytest.raises(ValueError, match="head_dim=16"):
        tiny_config(261, hidden_size=32, num_heads=2)
