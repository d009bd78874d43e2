"""A checkpoint exported as a Hugging Face directory (ppoflow.infra.checkpoint.hf_export): the same
logits as the trained ranks, published whole or not at all."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from ppoflow.demo.tiny_models import save_tiny_model
from ppoflow.infra.checkpoint import sharded as ck
from ppoflow.infra.checkpoint.hf_export import export_hf
from tests.support.ckpt.common import batch, max_diff

pytestmark = pytest.mark.slow


def test_export_hf_gives_the_same_logits(ckpt_run, tmp_path):
    from transformers import AutoModelForCausalLM

    work = ckpt_run["work"]
    out = export_hf(os.path.join(work, "c2"), str(tmp_path / "hf"), os.path.join(work, "base"))
    names = sorted(os.listdir(out))
    assert "model.safetensors" in names and "tokenizer_config.json" in names and "config.json" in names
    assert "lm_head.weight" not in load_file(os.path.join(out, "model.safetensors")), "tied: no lm_head"
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=batch(9)).logits
    saved = load_file(os.path.join(work, "logits.safetensors"))["logits"]
    assert float((logits - saved).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="does not match the architecture"):
        save_tiny_model(str(tmp_path / "other"), hidden_size=128, num_heads=4)
        export_hf(os.path.join(work, "c2"), str(tmp_path / "bad"), str(tmp_path / "other"))


def test_export_hf_publishes_whole_or_not_at_all(ckpt_run, tmp_path, monkeypatch):
    """A write that fails half way (disk full on the second shard) leaves no new directory and an
    earlier export untouched; a re-export into it replaces its weights and keeps the user's files."""
    import safetensors.torch

    ckpt, base = os.path.join(ckpt_run["work"], "c2"), os.path.join(ckpt_run["work"], "base")
    real_save, calls = safetensors.torch.save_file, []

    def full_disk_on_second(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second)
    with pytest.raises(OSError, match="No space left"):
        export_hf(ckpt, str(tmp_path / "new"), base, max_shard_bytes=64 * 1024)
    assert sorted(os.listdir(tmp_path)) == [], "nothing of the failed export is left"

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    old = export_hf(ckpt, str(tmp_path / "old"), base, max_shard_bytes=64 * 1024)
    assert oct(os.stat(old).st_mode & 0o777) == "0o755"
    shards = sorted(n for n in os.listdir(old) if n.endswith(".safetensors"))
    assert len(shards) > 2 and "model.safetensors.index.json" in os.listdir(old)
    before = {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)}
    calls.clear()
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second)
    with pytest.raises(OSError, match="No space left"):
        export_hf(ckpt, old, base, max_shard_bytes=64 * 1024)
    assert {n: open(os.path.join(old, n), "rb").read() for n in os.listdir(old)} == before
    assert sorted(os.listdir(tmp_path)) == ["old"]

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    with open(os.path.join(old, "NOTES.md"), "w") as f:
        f.write("mine")
    export_hf(ckpt, old, base)  # one shard now: the old shards and index go
    names = sorted(os.listdir(old))
    assert "model.safetensors" in names and "NOTES.md" in names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    exported = load_file(os.path.join(old, "model.safetensors"))
    full = ck.load_full_state_dict(ckpt)
    assert max_diff(exported, {k: full[k] for k in exported}) == 0.0
