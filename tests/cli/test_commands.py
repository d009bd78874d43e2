"""The commands that read or change an experiment on storage (``ppoflow status``, ``export-hf``,
``tensorboard``), on the small demo experiment of tests/scenarios/test_demo.py (built once per session)."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli.test_main import run_cli


@pytest.mark.slow
def test_status_prints_manifest_and_metrics(demo, capsys):
    code, out, _ = run_cli(capsys, "status", demo["url"])
    assert code == 0
    assert "iteration" in out and "2 (committed" in out and "checkpoints/actor/000002" in out
    assert "critic/score/mean" in out and "metrics of iteration 2" in out
    code, out, _ = run_cli(capsys, "status", os.path.join(demo["root"], "config.yaml"), "--json")
    data = json.loads(out)
    assert code == 0 and data["manifest"]["iteration"] == 2 and "actor/entropy" in data["metrics"]


@pytest.mark.slow
def test_export_hf_latest_and_earlier_iteration(demo, capsys, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.infra.checkpoint.sharded import load_full_state_dict

    out_dir = str(tmp_path / "hf")
    code, out, _ = run_cli(capsys, "export-hf", demo["url"], out_dir)
    assert code == 0 and "iteration 2" in out
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    saved = load_full_state_dict(os.path.join(demo["url"], "checkpoints", "actor", "000002"))
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "max(3,7)="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert model.generate(**ids, max_new_tokens=2, do_sample=False).shape[1] >= ids["input_ids"].shape[1] + 1

    code, out, _ = run_cli(capsys, "export-hf", demo["url"], str(tmp_path / "hf1"), "--iteration", "1")
    assert code == 0 and "iteration 1" in out
    code, _, err = run_cli(capsys, "export-hf", demo["url"], str(tmp_path / "hf9"), "--iteration", "9")
    assert code == 1 and "last committed iteration is 2" in err


@pytest.mark.slow
def test_tensorboard_writes_the_experiments_metrics(demo, capsys, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, out, _ = run_cli(capsys, "tensorboard", demo["url"], "--logdir", str(tmp_path / "tb"))
    assert code == 0 and "wrote 2 iteration(s)" in out and "tensorboard --logdir" in out
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("critic/score/mean")] == [1, 2]
