"""PEFT's adapter format for LoRA checkpoints: the names, the directory, and the export of a
checkpoint that holds only adapters (a run with ``actor.lora``).

    write_adapter_dir("out/adapter", {peft_name(n): t, ...}, cfg.actor.lora, base_model_path)
    export_lora(checkpoint_url, "export/actor-12", base, cfg.actor.lora)               # adapter dir
    export_lora(checkpoint_url, "export/actor-12", base, cfg.actor.lora, merge=True)   # HF model dir

The adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) loads with
``PeftModel.from_pretrained(base_model, dir)`` and serves in vLLM as a ``LoRARequest``. ``merge``
lets PEFT merge the adapters into the base weights (``merge_and_unload``) and writes a plain
Hugging Face directory like :func:`~ppoflow.infra.checkpoint.hf_export.export_hf`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict

if TYPE_CHECKING:
    from ppoflow.infra.config import LoRAConfig

__all__ = ["ADAPTER", "peft_config", "peft_name", "write_adapter_dir", "is_lora_state", "export_lora"]

ADAPTER = "default"  # PEFT's adapter name (one adapter per model)


def peft_config(cfg: LoRAConfig, exclude: list[str] | None = None, base_model: str | None = None) -> Any:
    """PEFT's ``LoraConfig`` of an ``actor.lora`` / ``critic.lora`` section; ``exclude``: module
    names that get no adapter (a critic's head, trained whole)."""
    from peft import LoraConfig

    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # PEFT annotates an int; it scales by any number
        lora_dropout=cfg.dropout,
        target_modules=targets,
        exclude_modules=exclude or None,
        bias="none",
        base_model_name_or_path=base_model,
    )


def peft_name(name: str) -> str:
    """A parameter's (HF-style) name in a ppoflow model or checkpoint -> its name in PEFT's
    ``adapter_model.safetensors``: ``model.layers.0.self_attn.q_proj.lora_A.default.weight`` ->
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def is_lora_state(names: Any) -> bool:
    """Whether a checkpoint's tensor names are a LoRA model's (adapters only)."""
    return any(".lora_A." in n for n in names)


def write_adapter_dir(
    path: str,
    tensors: dict[str, torch.Tensor],
    cfg: LoRAConfig,
    base_model: str,
    exclude: list[str] | None = None,
) -> str:
    """PEFT's adapter directory at local ``path`` from tensors by PEFT name. Written in a temporary
    sibling and renamed: it appears whole (an existing directory there is replaced)."""
    from safetensors.torch import save_file

    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    os.chmod(staging, 0o755)
    try:
        peft_config(cfg, exclude=exclude, base_model=base_model).save_pretrained(staging)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            os.path.join(staging, "adapter_model.safetensors"),
            metadata={"format": "pt"},
        )
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.rename(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def export_lora(
    checkpoint_url: str,
    out_dir: str,
    base_model_path: str,
    lora: LoRAConfig,
    *,
    merge: bool = False,
    dtype: str | None = None,
    storage_options: dict | None = None,
    trust_remote_code: bool = False,
) -> str:
    """Export a LoRA policy checkpoint: PEFT's adapter directory, or with ``merge`` the merged model
    as a Hugging Face directory (config and tokenizer copied from ``base_model_path``).

    ``lora`` is the run's ``actor.lora`` (rank, alpha, targets: what the adapter config records).
    ``dtype`` casts the written tensors. Returns ``out_dir``."""
    from ppoflow.infra.checkpoint.hf_export import publish_hf_dir

    tensors = load_full_state_dict(checkpoint_url, storage_options=storage_options)
    if not is_lora_state(tensors):
        raise ValueError(f"checkpoint {checkpoint_url} holds no LoRA adapters; export it with export_hf")
    others = sorted(k for k in tensors if ".lora_A." not in k and ".lora_B." not in k)
    if others:
        raise ValueError(
            f"checkpoint {checkpoint_url} holds tensors besides the adapters ({others[:3]}): a "
            "critic's? only the policy's adapters export this way"
        )
    if dtype is not None:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    adapter = {peft_name(k): v for k, v in tensors.items()}
    if not merge:
        return write_adapter_dir(out_dir, adapter, lora, base_model_path)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="ppoflow-adapter-") as tmp:
        adapter_dir = write_adapter_dir(os.path.join(tmp, "adapter"), adapter, lora, base_model_path)
        base = AutoModelForCausalLM.from_pretrained(
            base_model_path, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        state = {k: v.detach() for k, v in merged.state_dict().items()}
    return publish_hf_dir(state, out_dir, base_model_path, dtype=dtype, trust_remote_code=trust_remote_code)
