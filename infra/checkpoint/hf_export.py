"""Export a ppoflow (DCP) checkpoint as a Hugging Face model directory.

    export_hf("runs/exp/checkpoints/actor/000012", "export/actor-12", base_model_path=cfg.model.path)
    AutoModelForCausalLM.from_pretrained("export/actor-12")      # same logits as the saving model

The config, generation config, tokenizer and chat template are copied from the base model
directory (every file that is not a weight file); the tokenizer's files from the run's tokenizer
directory instead when it is another (``model.tokenizer_path``: ``tokenizer_path``), so that the
export renders prompts as training did. The weights come from the checkpoint as
safetensors (``model.safetensors``, or shards + ``model.safetensors.index.json`` above
``max_shard_bytes``). Tied models get no ``lm_head.weight`` (transformers and vLLM re-tie it).
``config.json`` records the dtype the weights are written in (the checkpoint's, or ``dtype``).
Before writing, the checkpoint's tensor names and shapes are checked against the architecture in
the base config (built on the meta device), so a wrong checkpoint fails here, not silently later;
then the tensors are written in the layout the architecture's checkpoints use (``save_pretrained``'s:
a model transformers trains in another layout, such as Qwen3-MoE's fused experts, is converted back).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict

__all__ = ["export_hf", "publish_hf_dir", "checkpoint_layout"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")
#: The files transformers saves a tokenizer as (the ones an export takes from ``tokenizer_path``).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def _expected_state(base_model_path: str, trust_remote_code: bool) -> tuple[dict[str, torch.Size], bool, Any]:
    """(name -> shape of every tensor the architecture trains, tie_word_embeddings, the model on
    the meta device)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(base_model_path, trust_remote_code=trust_remote_code)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(
            f"{base_model_path}/config.json names no architecture transformers knows (architectures="
            f"{getattr(config, 'architectures', None)}); export_hf needs it to check the weights"
        )
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_cfg, "tie_word_embeddings", False))
    with torch.device("meta"):
        model = cls._from_config(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if tied:
        shapes.pop("lm_head.weight", None)
    return shapes, tied, model


def checkpoint_layout(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (the trained names and layouts) as the architecture's checkpoints store them:
    transformers' reverse conversion, what ``save_pretrained`` writes (Qwen3-MoE's fused experts
    one expert and projection at a time), so that vLLM and older readers load the export."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_hf(
    checkpoint_url: str,
    out_dir: str,
    base_model_path: str,
    *,
    dtype: str | None = None,
    storage_options: dict | None = None,
    max_shard_bytes: int = 5 * 2**30,
    trust_remote_code: bool = False,
    tokenizer_path: str | None = None,
) -> str:
    """Write a Hugging Face directory at local ``out_dir`` from a published checkpoint.

    Args:
        checkpoint_url: a checkpoint written by ``ppoflow.infra.checkpoint.sharded.save_checkpoint``.
        out_dir: local directory. Written in a temporary sibling first: a new directory appears
            whole; in an existing one the weight files are replaced (other files are kept).
        base_model_path: the local HF directory the run started from (config + tokenizer source).
        dtype: cast floating tensors (e.g. ``"bfloat16"``) and record it in config.json;
            None keeps the checkpoint's dtype.
        max_shard_bytes: safetensors shard size.
        tokenizer_path: the run's tokenizer directory (``model.tokenizer_path``) when it is not
            ``base_model_path``: its tokenizer files are the export's.

    Returns:
        ``out_dir``.
    """
    tensors = load_full_state_dict(checkpoint_url, storage_options=storage_options)
    if any(".lora_A." in k for k in tensors):
        raise ValueError(
            f"checkpoint {checkpoint_url} holds LoRA adapters only: export it with "
            "ppoflow.infra.checkpoint.lora_export.export_lora (ppoflow export-hf does)"
        )
    return publish_hf_dir(
        tensors,
        out_dir,
        base_model_path,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        trust_remote_code=trust_remote_code,
        source=checkpoint_url,
        tokenizer_path=tokenizer_path,
    )


def publish_hf_dir(
    tensors: dict[str, torch.Tensor],
    out_dir: str,
    base_model_path: str,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    trust_remote_code: bool = False,
    source: str = "the weights",
    tokenizer_path: str | None = None,
) -> str:
    """Write full model ``tensors`` (HF names) as a Hugging Face directory at local ``out_dir``,
    checked against ``base_model_path``'s architecture (see :func:`export_hf`; ``source`` names
    the tensors' origin in errors)."""
    if not os.path.isdir(base_model_path):
        raise FileNotFoundError(
            f"base model directory {base_model_path} does not exist; export_hf copies the config "
            "and tokenizer from a local HF directory (the run's model.path)"
        )
    if tokenizer_path is not None and not os.path.isdir(tokenizer_path):
        raise FileNotFoundError(
            f"tokenizer directory {tokenizer_path} does not exist; export_hf copies the run's "
            "tokenizer (model.tokenizer_path) from a local directory"
        )
    if os.path.abspath(out_dir) == os.path.abspath(base_model_path):
        raise ValueError(
            f"export_hf: out_dir {out_dir} is the base model directory; choose another directory"
        )
    shapes, tied, model = _expected_state(base_model_path, trust_remote_code)
    if tied:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    _check_matches(tensors, shapes, source, base_model_path)
    tensors = checkpoint_layout(model, tensors)
    if dtype is not None:
        target = getattr(torch, dtype)
        tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would otherwise become the published directory's mode
    try:
        _write_directory(staging, tensors, base_model_path, dtype, max_shard_bytes, tokenizer_path)
        _publish(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_matches(
    tensors: dict[str, torch.Tensor], shapes: dict[str, torch.Size], url: str, base: str
) -> None:
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    wrong = sorted(k for k in set(shapes) & set(tensors) if tuple(shapes[k]) != tuple(tensors[k].shape))
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint {url} does not match the architecture of {base}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}; "
            "export it against the base model the run was trained from"
        )


def _write_directory(
    out: str,
    tensors: dict[str, torch.Tensor],
    base: str,
    dtype: str | None,
    max_shard_bytes: int,
    tokenizer: str | None = None,
) -> None:
    """The whole HF directory in ``out``: the base model's non-weight files (the tokenizer's from
    ``tokenizer`` when given), the weights' dtype in the config, then the weights."""
    from safetensors.torch import save_file

    if tokenizer is not None and os.path.abspath(tokenizer) == os.path.abspath(base):
        tokenizer = None
    for name in os.listdir(base):
        src = os.path.join(base, name)
        if tokenizer is not None and name in TOKENIZER_FILES:
            continue
        if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(src, os.path.join(out, name))
    if tokenizer is not None:
        for name in os.listdir(tokenizer):
            if name in TOKENIZER_FILES and os.path.isfile(os.path.join(tokenizer, name)):
                shutil.copyfile(os.path.join(tokenizer, name), os.path.join(out, name))
    floating = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    written = dtype if dtype is not None else (floating.pop() if len(floating) == 1 else None)
    if written is not None:
        _set_config_dtype(os.path.join(out, "config.json"), written)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _publish(staging: str, out_dir: str) -> None:
    """A new ``out_dir`` appears whole (one rename). An existing one keeps its other files: each new
    file is renamed in (the weights before config and index), then the old weight files that the
    new export did not replace go, so the directory is never left without weights."""
    if not os.path.exists(out_dir):
        os.rename(staging, out_dir)
        return
    if not os.path.isdir(out_dir):
        raise NotADirectoryError(f"export_hf: {out_dir} exists and is not a directory; choose another path")
    new = os.listdir(staging)
    stale = [n for n in os.listdir(out_dir) if n.endswith(_WEIGHT_SUFFIXES) and n not in new]
    for name in sorted(new, key=lambda n: (not n.endswith(".safetensors"), n.endswith(".json"), n)):
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    for name in stale:
        os.remove(os.path.join(out_dir, name))


def _set_config_dtype(path: str, dtype: str) -> None:
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("dtype", cfg.get("torch_dtype")) == dtype:
        return  # the base's file as it is
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
