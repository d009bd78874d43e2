"""Held-out evaluation in the real flow (2 CPU ranks, vLLM, a tiny policy), checked against an
independent reference: the evaluation's greedy responses are what a plain transformers
``generate`` of the same weights answers (the base model for iteration 0, ``export-hf`` of the
checkpoint for iteration 2), and its scores are the reward function applied to those texts by
hand. Then ``ppo-eval`` on a committed iteration gives the same result from a group of its own,
and finds the training's evaluation instead of repeating it.

What ``ppo-eval`` evaluates (``target_of``: the checkpoint, where the result goes, the errors for
what cannot be evaluated) is checked first, on a synthetic experiment, without ranks."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.ipc
import pyarrow.parquet as pq
import pytest
import torch

from ppoflow.flows.evaluate import target_of
from ppoflow.infra.checkpoint.marker import MARKER
from ppoflow.infra.config import ConfigError, parse_config
from ppoflow.infra.data import storage
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest
from tests.support.configs import LIGHT
from tests.support.fake_experiments import fake_experiment
from tests.support.rewards import digit_share

PROMPTS = 6


def test_what_ppo_eval_evaluates_and_what_it_refuses(tmp_path):
    cfg = parse_config(
        {
            "model": {"path": "base-model", "tokenizer_path": "base-tokenizer"},
            "data": {"train_files": ["train.parquet"], "val_files": ["val.parquet"]},
            "storage": {"root": str(tmp_path), "experiment": "exp"},
        }
    )
    val = ["val.parquet"]
    with pytest.raises(ConfigError, match=r"no experiment at .*exp: nothing committed to evaluate"):
        target_of(cfg, None, val, None)
    paths = fake_experiment(str(tmp_path), 2, one_step=False)  # commits 0..2, at <root>/exp
    assert target_of(cfg, None, val, None) == (
        cfg,
        paths.checkpoint("actor", 2),
        paths.file(2, "eval/val"),
        "val",
        2,
    )
    same, checkpoint, out_dir, tag, n = target_of(cfg, 1, ["other.parquet"], None)
    assert (same, checkpoint, n) == (cfg, paths.checkpoint("actor", 1), 1)
    assert tag.startswith("files-") and out_dir == paths.file(1, f"eval/{tag}")
    with pytest.raises(ConfigError, match="iteration 3 is not committed: .* last committed iteration is 2"):
        target_of(cfg, 3, val, None)
    os.remove(os.path.join(paths.checkpoint("actor", 1), MARKER))
    with pytest.raises(ConfigError, match=r"actor checkpoint of iteration 1 .* is not complete .*keep_last"):
        target_of(cfg, 1, val, None)
    # a model directory: the config's settings on that model, the result beside the experiment
    mcfg, checkpoint, out_dir, tag, n = target_of(cfg, None, val, "/models/My Model/")
    assert (mcfg.model.path, mcfg.model.tokenizer_path, checkpoint, n) == (
        "/models/My Model/",
        None,
        None,
        None,
    )
    assert out_dir == storage.join(paths.root, "evaluations", "My-Model", "val") and tag == "val"
    with pytest.raises(ConfigError, match="either a model directory or an iteration"):
        target_of(cfg, 2, val, "/models/m")


def _val_file(path) -> str:
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i * 7}-{i}="}],
            "reward_model": {"ground_truth": str(i * 6), "style": "rule"},
            "extra_info": {"index": i},
        }
        for i in range(PROMPTS + 2)  # two more than evaluated: max_prompts caps
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _generations(url: str) -> dict[str, list]:
    with pa.OSFile(url) as f:
        return pyarrow.ipc.open_file(f).read_all().to_pydict()


def _hf_greedy(model_dir: str, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of a plain transformers model, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for content in prompts:
        text = tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
            )
        out.append(tok.decode(gen[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
    return out


@pytest.mark.slow
def test_evaluation_during_training_and_on_demand(prefect_harness, flow_config, flow_assets, tmp_path):
    from ppoflow.flows.evaluate import evaluate
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.checkpoint.hf_export import export_hf

    val = _val_file(tmp_path / "val.parquet")
    cfg = flow_config(
        str(tmp_path / "runs"),
        "evaluated",
        **LIGHT,
        **{
            "data.val_files": [val],
            "evaluation.every": 2,
            "evaluation.max_prompts": PROMPTS,
            "reward.custom_function": "tests.support.rewards:digit_share",
        },
    )
    paths = ExperimentPaths.of(cfg)
    ppo(cfg, iterations=3)

    # iteration 0 (before training), 2 (every 2nd) and 3 (the run's last) were evaluated, 1 not
    per_iteration = {n: json.loads(open(paths.file(n, "metrics.json")).read()) for n in (1, 2, 3)}
    assert "val/score" not in per_iteration[1]
    assert {"val/score", "val/openai/gsm8k/score/mean@1", "val/openai/gsm8k/response_length/mean"} <= set(
        per_iteration[2]
    )
    assert "val/score" in per_iteration[3] and "timing_s/evaluate" in per_iteration[3]
    trend = read_manifest(paths).trend
    assert [r["iteration"] for r in trend if "val/score" in r] == [0, 2, 3]

    responses = cfg.rollout.response_length
    for n, model_dir in ((0, flow_assets["model"]), (2, None)):
        gen = _generations(paths.file(n, "eval/val/generations.arrow"))
        assert gen["index"] == list(range(PROMPTS)) and gen["sample"] == [0] * PROMPTS
        if model_dir is None:  # the committed weights of iteration 2, as a plain HF directory
            model_dir = export_hf(paths.checkpoint("actor", 2), str(tmp_path / "hf-2"), flow_assets["model"])
        reference = _hf_greedy(model_dir, gen["prompt"], responses)
        assert gen["response"] == reference, n
        by_hand = [digit_share("openai/gsm8k", text, None) for text in reference]
        assert gen["score"] == pytest.approx(by_hand, abs=0)
        metrics = json.loads(open(paths.file(n, "eval/val/metrics.json")).read())
        assert metrics["val/score"] == pytest.approx(sum(by_hand) / PROMPTS)
        assert metrics["val/prompts"] == PROMPTS

    # on demand: the same iteration and files are found, not recomputed; other files are
    # evaluated by a fresh group (policy + engine only) on the checkpoint, with the same result
    found = evaluate(cfg, iteration=2)
    assert found["resumed"] and found["metrics"]["val/score"] == per_iteration[2]["val/score"]
    copy = shutil.copy(val, tmp_path / "val-copy.parquet")
    again = evaluate(cfg, iteration=2, files=[str(copy)])
    assert not again["resumed"] and again["tag"].startswith("files-")
    assert again["metrics"]["val/score"] == per_iteration[2]["val/score"]
    assert (
        _generations(storage.join(again["out_dir"], "generations.arrow"))["response"]
        == _generations(paths.file(2, "eval/val/generations.arrow"))["response"]
    )
