"""A weights-only checkpoint written in a narrower dtype (policy versions for bf16 engines): each
tensor is the model's rounded to nearest, as an engine's in-place load (``param.copy_``) rounds
the full-precision one; the files hold half the bytes; a state with optimizer refuses it."""

from __future__ import annotations

import os

import pytest
import torch

from ppoflow.infra.checkpoint.marker import read_marker
from ppoflow.infra.checkpoint.sharded import model_tensor_bytes
from ppoflow.infra.checkpoint.writer import CheckpointWriter
from ppoflow.workers.rollout.weight_sync import checkpoint_weights


def _model(tmp_path):
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import save_tiny_model

    save_tiny_model(str(tmp_path / "base"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    with torch.no_grad():  # values with bits below bf16's precision, both signs, ties excluded
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    return model


def _bytes(url: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(url) for f in fs if f.endswith(".distcp")
    )


def test_a_bf16_policy_version_holds_what_an_engine_loads_from_the_fp32_one(tmp_path):
    model = _model(tmp_path)
    writer = CheckpointWriter()
    full, half = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    writer.save(full, model, extra={"policy_version": 1})
    writer.save(half, model, extra={"policy_version": 1}, dtype=torch.bfloat16)
    assert read_marker(half)["dtype"] == "bfloat16" and read_marker(full)["dtype"] is None
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    got = dict(checkpoint_weights(half, names))
    assert set(got) == set(names)
    for name, tensor in checkpoint_weights(full, names):
        assert tensor.dtype == torch.float32 and torch.equal(tensor, params[name].detach())
        # the reference: an engine's bf16 parameter loaded in place from the fp32 version
        engine_param = torch.empty(tensor.shape, dtype=torch.bfloat16)
        engine_param.copy_(tensor)
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], engine_param), name
    assert sum(model_tensor_bytes(half).values()) * 2 == sum(model_tensor_bytes(full).values())
    assert _bytes(half) < 0.55 * _bytes(full)


def test_a_narrower_dtype_with_the_optimizer_is_refused(tmp_path):
    model = _model(tmp_path)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="weights only"):
        CheckpointWriter().save(str(tmp_path / "x"), model, opt, dtype=torch.bfloat16)
    assert not os.path.exists(tmp_path / "x" / "ppoflow_complete.json")


def test_alternating_full_and_narrow_background_saves_keep_their_host_buffers(tmp_path):
    """The actor's writer stages snapshots in fp32 and policy versions in bf16, in the background:
    each kind keeps its own host buffers across the switches (no reallocation), and each write
    holds its own dtype."""
    model = _model(tmp_path)
    writer = CheckpointWriter()
    buffers = []
    for i, dtype in enumerate((None, torch.bfloat16, None, torch.bfloat16)):
        writer.save(str(tmp_path / f"c{i}"), model, background=True, dtype=dtype)
        writer.wait()
        buffers.append({k: id(v[1]) for k, v in writer._stager._buffers.items()})
    assert buffers[0].items() <= buffers[3].items() and buffers[1].items() <= buffers[3].items()
    assert len(buffers[3]) == 2
    name = next(n for n, _ in model.named_parameters())
    for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)):
        got = dict(checkpoint_weights(str(tmp_path / f"c{i}"), [name]))
        assert got[name].dtype == dtype
        assert torch.equal(got[name], dict(model.named_parameters())[name].detach().to(dtype))
