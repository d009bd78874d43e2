"""Tiny models and a character tokenizer built locally, for tests, the demo and benchmarks.

Tests, the demo and benchmarks need no model hub: everything small is made from a transformers
config and saved with ``save_pretrained`` as a normal Hugging Face directory
that ``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and vLLM load.
Head dim is kept >= 32 (vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, ...).
"""

from __future__ import annotations

import os
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2's table)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_char_tokenizer():
    """A byte-level tokenizer with no merges: one token per byte, plus chat/pad/eos special tokens.

    It is a real ``Qwen2Tokenizer`` (byte-level BPE with an empty merge list), so
    ``AutoTokenizer.from_pretrained`` and vLLM load it exactly as they load Qwen2's own tokenizer.
    Ids: the special tokens first (eos 0, pad 1), then bytes 0..255 at 5..260.
    """
    from transformers import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for sym in _byte_symbols():
        vocab[sym] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,  # type: ignore[arg-type]  # annotated str in transformers; None (no unknown token) works
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def tiny_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    **extra: Any,
):
    """A Qwen2-shaped config; head_dim = hidden_size / num_heads must be >= 32."""
    from transformers import Qwen2Config

    if hidden_size // num_heads < 32:
        raise ValueError(
            f"head_dim={hidden_size // num_heads} < 32: vLLM's CPU attention needs 32, 64, 80, ...; "
            "use fewer heads or a larger hidden_size"
        )
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        **extra,
    )


def save_tiny_model(
    out_dir: str, *, seed: int = 0, dtype: str = "float32", arch: str | None = None, **config_kw: Any
) -> str:
    """Build a random tiny causal LM + char tokenizer and save both to ``out_dir``; returns it.

    ``arch``: a row of the model matrix (``ppoflow.infra.architectures``, e.g. ``"gemma3_text"``)
    built from its own tiny config (``config_kw`` override its fields, ``tied=`` its embeddings);
    None: the Qwen2 shape of :func:`tiny_config`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_char_tokenizer()
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch is not None:
        from ppoflow.infra.architectures import tiny_config as arch_config

        cfg = arch_config(arch, len(tok), **ids, **config_kw)
    else:
        cfg = tiny_config(len(tok), **ids, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def save_tiny_reward_model(out_dir: str, *, seed: int = 1, **config_kw: Any) -> str:
    """A tiny sequence-classification reward model (one label) with its own char tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **config_kw)
    cfg.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
