"""The trainer's tensors in the engine's names and layouts (ppoflow.workers.rollout.engine_format),
against what ``save_pretrained`` writes to disk (the checkpoint vLLM loads at start-up): Qwen3-MoE's
fused experts come out one expert and projection at a time, GPT-OSS's experts one expert at a time
for the CPU build's in-place reload and fused (as on disk) for the GPU build's ``load_weights``, its
sinks held back either way, a dense model unchanged. vLLM taking them (log-probs after a push) is in
tests/scenarios/test_model_matrix.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from ppoflow.workers.rollout.engine_format import EngineFormat


def _saved(tmp_path, arch: str):
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import save_tiny_model

    path = save_tiny_model(str(tmp_path / arch), arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model, load_file(f"{path}/model.safetensors")


def _live(model):
    return ((name, p.detach()) for name, p in model.named_parameters())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_the_stream_is_the_checkpoint_on_disk(arch, tmp_path):
    model, disk = _saved(tmp_path, arch)
    fmt = EngineFormat(model)
    got = dict(fmt.stream(_live(model)))
    assert fmt.converts is (arch == "qwen3_moe") and fmt.held == {}
    assert sorted(got) == sorted(disk)
    for name, tensor in disk.items():
        assert torch.equal(got[name], tensor), name
    if arch == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in got
        assert not any(name.endswith("experts.gate_up_proj") for name in got)


def test_gpt_oss_experts_one_by_one_and_sinks_held_back(tmp_path):
    model, disk = _saved(tmp_path, "gpt_oss")
    fmt = EngineFormat(model)
    got = dict(fmt.stream(_live(model)))
    assert sorted(fmt.held) == ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]
    for name, tensor in disk.items():
        owner, _, leaf = name.rpartition(".")
        if name in fmt.held:
            assert torch.equal(fmt.held[name], tensor) and name not in got
        elif owner.endswith("mlp.experts"):
            experts = [got.pop(f"{owner}.{e}.{leaf}") for e in range(tensor.shape[0])]
            assert torch.equal(torch.stack(experts), tensor), name
        else:
            assert torch.equal(got.pop(name), tensor), name
    assert got == {}  # nothing the checkpoint lacks


def test_gpt_oss_experts_fused_for_load_weights(tmp_path):
    """The GPU build's GPT-OSS loader narrows the fused (E, H, 2I) tensor for its TP rank and has no
    per-expert path: there the stream is the checkpoint on disk, less the held sinks."""
    model, disk = _saved(tmp_path, "gpt_oss")
    fmt = EngineFormat(model, split_experts=False)
    got = dict(fmt.stream(_live(model)))
    assert sorted(fmt.held) == ["model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"]
    assert sorted(got) == sorted(name for name in disk if name not in fmt.held)
    for name, tensor in got.items():
        assert torch.equal(tensor, disk[name]), name
    assert got["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
