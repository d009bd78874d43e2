"""Rule rewards (ppoflow.infra.rewards) in-process, and RewardModelWorker on 2 gloo ranks vs a
single-process Hugging Face ``AutoModelForSequenceClassification`` forward on the last token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ppoflow.infra import rewards
from ppoflow.infra.rewards import (
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k_score,
    register_reward,
    score_batch,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def my_score(data_source, solution_str, ground_truth, extra_info):
    """Custom reward used by the tests by import path: length match, as a dict with extra fields."""
    return {"score": float(len(solution_str) == int(ground_truth)), "length": len(solution_str)}


NOT_A_FUNCTION = 3


# ------------------------------------------------------------------------------------------ rules


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is\n#### 72", "72", 1.0),
        ("#### 71", "72", 0.0),  # wrong
        ("the answer is 72", "72", 0.0),  # no #### answer
        ("#### 1,234", "1234", 1.0),  # commas in the response
        ("#### 1234", "1,234", 1.0),  # commas in the ground truth
        ("#### $1,234.00", "1234", 1.0),  # dollar sign, decimals
        ("#### -5", "-5", 1.0),  # negative
        ("#### -$5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("#### 0.5", "0.50", 1.0),  # decimals compare numerically
        ("#### .5", "0.5", 1.0),
        ("#### 3.14.", "3.14", 1.0),  # trailing full stop
        ("#### 1\nwait, no\n#### 2", "2", 1.0),  # the last answer counts
        ("#### 2\n#### ", "2", 1.0),  # ... the last parsable one
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # a full GSM8K solution as truth
    ],
)
def test_gsm8k_cases(response, truth, expected):
    assert gsm8k_score("openai/gsm8k", response, truth, None) == expected


def test_gsm8k_format_score_and_bad_truth():
    assert gsm8k_score("gsm8k", "#### 7", "8", {"format_score": 0.1}) == pytest.approx(0.1)
    assert gsm8k_score("gsm8k", "no answer", "8", {"format_score": 0.1}) == 0.0
    assert extract_gsm8k_answer("nothing here") is None
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_score("gsm8k", "#### 7", "seven", None)


def test_score_batch_registry_and_dtype():
    scores = score_batch(
        ["openai/gsm8k", "gsm8k", "openai/gsm8k"],
        ["#### 4", "#### 5", "none"],
        ["4", "4", "4"],
        [None, None, None],
    )
    assert scores.dtype == np.float32 and scores.tolist() == [1.0, 0.0, 0.0]
    assert get_reward_fn("openai/gsm8k") is gsm8k_score


def test_unknown_data_source_names_known_ones_and_how_to_register():
    with pytest.raises(KeyError) as err:
        score_batch(["my/dataset"], ["x"], ["1"], [None])
    msg = str(err.value)
    assert (
        "my/dataset" in msg
        and "openai/gsm8k" in msg
        and "register_reward" in msg
        and "custom_function" in msg
    )


def test_register_reward_and_duplicates():
    @register_reward("tests/const")
    def const(data_source, solution_str, ground_truth, extra_info=None):
        return 0.25

    try:
        assert score_batch(["tests/const"], ["x"], [None]).tolist() == [0.25]
        with pytest.raises(ValueError, match="already registered"):
            register_reward("tests/const")(lambda *a: 1.0)
        register_reward("tests/const", override=True)(lambda *a: 0.5)
        assert score_batch(["tests/const"], ["x"], [None]).tolist() == [0.5]
    finally:
        rewards._REGISTRY.pop("tests/const", None)


def test_custom_function_by_import_path(tmp_path):
    scores, info = rewards.score_batch_with_info(
        ["any", "thing"],
        ["abc", "ab"],
        ["3", "3"],
        [None, None],
        custom_function="tests.test_rewards:my_score",
    )
    assert scores.tolist() == [1.0, 0.0] and info["length"].tolist() == [3.0, 2.0]
    path = tmp_path / "my_rewards.py"
    path.write_text("def score(ds, s, gt, extra):\n    return 2.0 if s == gt else -1\n")
    assert score_batch(
        ["x", "x"], ["a", "b"], ["a", "a"], None, custom_function=f"{path}:score"
    ).tolist() == [2.0, -1.0]


@pytest.mark.parametrize(
    "path, error, match",
    [
        ("tests.test_rewards", ValueError, "package.module:function"),
        ("no_such_pkg.mod:fn", ImportError, "cannot import module 'no_such_pkg.mod'"),
        ("tests.test_rewards:missing", AttributeError, "has no 'missing'.*my_score"),
        ("tests.test_rewards:NOT_A_FUNCTION", TypeError, "not a function"),
        ("/nonexistent/file.py:fn", FileNotFoundError, "does not exist"),
    ],
)
def test_custom_function_bad_paths(path, error, match):
    with pytest.raises(error, match=match):
        score_batch(["x"], ["a"], ["a"], [None], custom_function=path)


def test_bad_return_values_are_named():
    with pytest.raises(TypeError, match="returned a str"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: "1.0")
    with pytest.raises(ValueError, match="without a 'score' key"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: {"acc": 1})
    with pytest.raises(ValueError, match="non-finite"):
        score_batch(["x"], ["a"], ["a"], None, custom_function=lambda *a: float("nan"))
    with pytest.raises(ValueError, match="lengths differ"):
        score_batch(["x", "y"], ["a"], ["a"], None)


# ------------------------------------------------------------------------------- reward model worker

PROMPTS = ["What is 2+3?", "Name a colour.", "Say hi", "Count to three:", "Why?", "Add 10 and 32."]
RESPONSES = ["#### 5", "blue, or maybe green", "hi!", "1 2 3", "because", "#### 42 since 10+32=42"]
OTHER_TEMPLATE = "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"


def _rollout(tok, with_raw_prompt: bool, p_len: int = 40, r_len: int = 24):
    """A left-padded prompt / right-padded response batch as the rollout writes it."""
    from ppoflow.infra.data.dataproto import DataProto

    n = len(PROMPTS)
    pad = tok.pad_token_id
    prompts = torch.full((n, p_len), pad, dtype=torch.long)
    responses = torch.full((n, r_len), pad, dtype=torch.long)
    p_mask = torch.zeros((n, p_len), dtype=torch.long)
    r_mask = torch.zeros((n, r_len), dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        pi = tok(text, add_special_tokens=False)["input_ids"]
        ri = (tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:r_len]
        prompts[i, -len(pi) :], p_mask[i, -len(pi) :] = torch.tensor(pi), 1
        responses[i, : len(ri)], r_mask[i, : len(ri)] = torch.tensor(ri), 1
    attn = torch.cat([p_mask, r_mask], 1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
        "response_mask": r_mask,
    }
    non_tensors = {"raw_prompt": list(PROMPTS)} if with_raw_prompt else {}
    return DataProto.from_dict(tensors, non_tensors)


def _reference(rm_dir: str, policy_tok, data, reencode: bool, max_length: int | None = None) -> list[float]:
    """Single-process HF forward of each unpadded sequence; the logit of its last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    out = []
    for i in range(len(data)):
        pm, rm = data.batch["attention_mask"][i, :40].bool(), data.batch["response_mask"][i].bool()
        if reencode:
            resp = policy_tok.decode(data.batch["responses"][i][rm].tolist(), skip_special_tokens=True)
            text = rm_tok.apply_chat_template(
                [{"role": "user", "content": PROMPTS[i]}, {"role": "assistant", "content": resp}],
                tokenize=False,
            )
            ids = rm_tok(text, add_special_tokens=False)["input_ids"][:max_length]
        else:
            ids = data.batch["prompts"][i][pm].tolist() + data.batch["responses"][i][rm].tolist()
        with torch.no_grad():
            out.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return out


@pytest.mark.slow
def test_reward_model_worker_on_two_ranks_matches_hf(tmp_path):
    from transformers import AutoTokenizer

    from ppoflow.demo.tiny_models import save_tiny_model, save_tiny_reward_model
    from ppoflow.infra.data.dataproto import DataProto

    work = str(tmp_path)
    policy = save_tiny_model(os.path.join(work, "policy"))
    rm_same = save_tiny_reward_model(os.path.join(work, "rm_same"))
    rm_other = save_tiny_reward_model(os.path.join(work, "rm_other"), seed=2)
    tok_other = AutoTokenizer.from_pretrained(rm_other)
    tok_other.chat_template = OTHER_TEMPLATE
    tok_other.save_pretrained(rm_other)
    policy_tok = AutoTokenizer.from_pretrained(policy)
    _rollout(policy_tok, True).save(os.path.join(work, "data_raw.arrow"))
    _rollout(policy_tok, False).save(os.path.join(work, "data_ids.arrow"))

    def config(rm_dir, max_length=None, max_tokens=None):
        rm = {
            "enable": True,
            "model": {"path": rm_dir},
            "micro_batch_size_per_gpu": 2,
            "max_length": max_length,
        }
        if max_tokens:  # packed micro-batches of at most max_tokens real tokens (no compute on padding)
            rm.update(use_dynamic_bsz=True, forward_max_token_len_per_gpu=max_tokens)
        return {
            "model": {"path": policy},
            "data": {"train_files": ["unused.parquet"]},
            "resources": {"nprocs": 2},
            "reward": {"reward_model": rm},
        }

    cases = [
        {"name": "same", "config": config(rm_same), "data": "data_raw.arrow"},
        {"name": "other", "config": config(rm_other), "data": "data_raw.arrow"},
        {"name": "other_trim", "config": config(rm_other, 30), "data": "data_ids.arrow"},
        {"name": "same_packed", "config": config(rm_same, max_tokens=64), "data": "data_raw.arrow"},
        {"name": "other_packed", "config": config(rm_other, max_tokens=64), "data": "data_raw.arrow"},
    ]
    with open(os.path.join(work, "cases.json"), "w") as f:
        json.dump(cases, f)
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        os.path.join(ROOT, "tests", "ckpt_scripts", "rm_ranks.py"),
        work,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    for case, rm_dir, reencode, max_len in (
        ("same", rm_same, False, None),
        ("other", rm_other, True, None),
        ("other_trim", rm_other, True, 30),
        ("same_packed", rm_same, False, None),
        ("other_packed", rm_other, True, None),
    ):
        init = json.load(open(os.path.join(work, f"init_{case}.json")))
        assert init["same_tokenizer"] is (not reencode)
        data = DataProto.load(os.path.join(work, cases[0]["data"]))
        got = torch.cat(
            [DataProto.load(os.path.join(work, f"out_{case}_{r}.arrow")).batch["rm_scores"] for r in range(2)]
        )
        assert got.dtype == torch.float32 and got.shape == data.batch["responses"].shape
        last = data.batch["response_mask"].sum(-1) - 1
        expected = torch.zeros_like(got)
        expected[torch.arange(len(got)), last] = torch.tensor(
            _reference(rm_dir, policy_tok, data, reencode, max_len)
        )
        assert torch.count_nonzero(got) == len(got)
        diff = float((got - expected).abs().max())
        print(f"\nRM {case}: max |2-rank FSDP - HF| = {diff:.2e}")
        assert diff <= 1e-5, (case, got, expected)
    # The trimmed case really trimmed: its scores differ from the untrimmed ones.
    full = torch.cat(
        [DataProto.load(os.path.join(work, f"out_other_{r}.arrow")).batch["rm_scores"] for r in range(2)]
    )
    trim = torch.cat(
        [DataProto.load(os.path.join(work, f"out_other_trim_{r}.arrow")).batch["rm_scores"] for r in range(2)]
    )
    assert not torch.allclose(full, trim)
