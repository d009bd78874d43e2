"""The configs of a matrix row (ppoflow.infra.architectures.tiny): the tiny one builds in
transformers' own class with what vLLM's CPU build needs (head size 32, the tokenizer's ids), and
the real small shape is the released model's where the row says so."""

from __future__ import annotations

import pytest

from ppoflow.infra.architectures import ARCHITECTURES, real_config, tiny_config

ROWS = [row.name for row in ARCHITECTURES]


@pytest.mark.parametrize("name", ROWS)
def test_tiny_config_is_the_rows_class_with_vllm_sized_heads(name):
    import transformers

    from ppoflow.infra.architectures.matrix import architecture_of

    row = architecture_of(name)
    cfg = tiny_config(name, 261, eos_token_id=0, pad_token_id=1)
    assert type(cfg) is getattr(transformers, row.config_class) and cfg.model_type == name
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head == 32 and cfg.hidden_size == 64 and cfg.num_hidden_layers == 2
    assert (cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id) == (261, 0, 1)
    assert cfg.tie_word_embeddings is row.tied
    assert tiny_config(name, 261, tied=not row.tied).tie_word_embeddings is (not row.tied)
    assert row.causal_lm in transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__


def test_real_shapes_of_released_models():
    qwen = real_config("qwen2")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.vocab_size, qwen.tie_word_embeddings) == (
        896,
        24,
        151936,
        True,
    )
    llama = real_config("llama")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_key_value_heads) == (2048, 16, 8)
    assert llama.rope_parameters["rope_type"] == "llama3"
    gemma = real_config("gemma3_text")
    assert gemma.layer_types.count("full_attention") == 4 and gemma.layer_types[5] == "full_attention"
    assert real_config("qwen2", vocab_size=261).vocab_size == 261


def test_an_unknown_architecture_names_the_rows():
    with pytest.raises(KeyError, match="no architecture 'gemma2' in the model matrix; it has qwen2, qwen3"):
        tiny_config("gemma2", 261)
