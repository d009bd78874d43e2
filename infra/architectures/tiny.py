"""transformers configs of a matrix row: the tiny one the CPU tests build and the real small shape
the GPU benchmark builds, each from the architecture's own config class (nothing downloaded).

    cfg = tiny_config("gemma3_text", vocab_size=261, eos_token_id=0, pad_token_id=1)
    cfg = real_config("llama")                  # Llama-3.2-1B's shape, random weights to come

The tiny config is :data:`~ppoflow.infra.architectures.matrix.TINY_COMMON` (hidden 64, 2 layers,
head_dim 32) plus the row's own fields; everything else keeps the config class's defaults, which
follow the released models (a norm's epsilon, say: vLLM's GPT-OSS reads none and uses 1e-5).
transformers is imported when a function runs, not with the module.
"""

from __future__ import annotations

from typing import Any

from ppoflow.infra.architectures.matrix import TINY_COMMON, Architecture, architecture_of

__all__ = ["tiny_config", "real_config", "row"]


def row(arch: str | Architecture) -> Architecture:
    """The matrix row of ``arch`` (a row, or its name); KeyError listing the rows otherwise."""
    if isinstance(arch, Architecture):
        return arch
    found = architecture_of(arch)
    if found is None:
        from ppoflow.infra.architectures.matrix import names

        raise KeyError(f"no architecture {arch!r} in the model matrix; it has {', '.join(names())}")
    return found


def _config(arch: Architecture, fields: dict[str, Any]):
    import copy

    import transformers

    return getattr(transformers, arch.config_class)(**copy.deepcopy(fields))


def _tokens(vocab_size: int, eos_token_id: int | None, pad_token_id: int | None) -> dict[str, Any]:
    """The special ids: a config class whose default pad id lies outside a small vocabulary (Phi-3's
    32000) gets the tokenizer's."""
    return dict(
        vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None
    )


def tiny_config(
    arch: str | Architecture,
    vocab_size: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tied: bool | None = None,
    **overrides: Any,
):
    """The row's tiny transformers config (``tied``: None = the row's own choice)."""
    arch = row(arch)
    fields = {
        **TINY_COMMON,
        **_tokens(vocab_size, eos_token_id, pad_token_id),
        "tie_word_embeddings": arch.tied if tied is None else tied,
        **arch.tiny,
        **overrides,
    }
    return _config(arch, fields)


def real_config(
    arch: str | Architecture,
    *,
    vocab_size: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    **overrides: Any,
):
    """The row's real small shape (``real_name``) as a transformers config; ``vocab_size`` None
    keeps the real vocabulary (the demo's byte tokenizer uses its first 261 ids)."""
    arch = row(arch)
    fields = {**arch.real, **overrides}
    vocab = vocab_size or fields.pop("vocab_size")
    fields.pop("vocab_size", None)
    fields.setdefault("tie_word_embeddings", arch.tied)
    return _config(arch, {**fields, **_tokens(vocab, eos_token_id, pad_token_id)})
