"""ppoflow.workers.reward_model_worker on 2 gloo ranks against a single-process Hugging Face AutoModelForSequenceClassification forward on the last token, with and without re-encoding under the reward model's own chat template."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.paths import ROOT

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
        os.path.join(ROOT, "tests", "support", "ckpt", "rm_ranks.py"),
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
