"""Supervised warm start: a short, single-process fine-tune on (prompt, response) pairs.

RL from a randomly initialised or untuned model wastes its first iterations learning to *talk*:
where a response ends, what an answer looks like. A warm start teaches that format by plain
supervised learning before PPO begins, the way an SFT stage precedes RLHF in LLM pipelines.

    from ppoflow.demo.sft import SFTConfig, sft
    summary = sft("runs/demo/base", "runs/demo/sft", examples, SFTConfig(steps=100, lr=1e-3))

``examples`` are ``(messages, response)`` pairs: ``messages`` a chat (``[{"role": "user",
"content": ...}]``) rendered with the tokenizer's chat template and generation prompt exactly as
the PPO flow renders prompts (``ppoflow.infra.data.prompts``), ``response`` the target text; the tokenizer's
EOS token is appended, so the model also learns to stop. The loss is the mean cross-entropy over
response tokens only (prompt tokens are context, not targets).

The demo uses it to teach the answer *format* with random answers (``ppoflow.demo.task``), so the
warm-started policy answers in the right shape but is right only by chance; every later gain
comes from PPO.

Plain torch on one device: no FSDP, no torch.distributed, no Prefect. The output is a normal
Hugging Face directory (model + tokenizer + ``sft.json`` with the run's settings and loss curve),
published by renaming a finished temporary directory, so a crash never leaves half a model there.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["SFTConfig", "sft", "encode_example", "SUMMARY_FILE"]

SUMMARY_FILE = "sft.json"
Example = tuple[list[dict[str, str]], str]


@dataclass
class SFTConfig:
    """Settings of one warm-start run."""

    steps: int = 100  # optimizer steps
    batch_size: int = 64  # examples per step (sampled with replacement)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10  # linear warm-up, then constant
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    threads: int | None = 1  # CPU threads while training (None: leave torch's setting);
    # a tiny model runs faster on one thread than on two
    log_every: int = 25  # steps between log lines (0: none)


def encode_example(tokenizer: Any, messages: list[dict[str, str]], response: str) -> tuple[list[int], int]:
    """Token ids of prompt + response + EOS, and the number of prompt tokens."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; the warm start teaches the model to stop with it")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt_ids + response_ids + [tokenizer.eos_token_id], len(prompt_ids)


def _batch(encoded: list[tuple[list[int], int]], rows: list[int], pad_id: int):
    """Right-padded (input_ids, attention_mask, loss_mask) for the chosen rows."""
    longest = max(len(encoded[r][0]) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), longest), dtype=torch.long)
    target = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, r in enumerate(rows):
        seq, n_prompt = encoded[r]
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        target[i, n_prompt : len(seq)] = True
    return ids, attn, target


def _loss(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    labels, mask = ids[:, 1:], target[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    ).view(labels.shape)
    return nll[mask].mean()


def sft(
    model_path: str,
    out_dir: str,
    examples: Sequence[Example],
    config: SFTConfig | None = None,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Fine-tune the model at ``model_path`` on ``examples``; save the result at ``out_dir``.

    Args:
        model_path: a Hugging Face model directory (model + tokenizer with a chat template).
        out_dir: a local directory; must not exist yet (the result is published by a rename).
        examples: ``(messages, response)`` pairs, see the module docstring.
        config: the run's settings.
        log: called with one line every ``config.log_every`` steps (None: silent).

    Returns:
        the summary written to ``out_dir/sft.json``: settings, loss at the start and end, seconds.
    """
    from transformers import AutoTokenizer

    cfg = config or SFTConfig()
    if not examples:
        raise ValueError("sft needs at least one (messages, response) example")
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; the warm start writes a new directory")
    started = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [encode_example(tokenizer, messages, response) for messages, response in examples]

    threads_before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train_and_save(model_path, out_dir, tokenizer, encoded, pad_id, cfg, log, started)
    finally:
        torch.set_num_threads(threads_before)


def _train_and_save(
    model_path: str,
    out_dir: str,
    tokenizer: Any,
    encoded: list[tuple[list[int], int]],
    pad_id: int,
    cfg: SFTConfig,
    log: Callable[[str], None] | None,
    started: float,
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    # transformers' @wraps(nn.Module.to) on PreTrainedModel.to hides the method's binding from mypy
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)  # type: ignore[arg-type]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    for step in range(cfg.steps):
        rows = torch.randint(len(encoded), (cfg.batch_size,), generator=gen).tolist()
        ids, attn, target = (t.to(device) for t in _batch(encoded, rows, pad_id))
        loss = _loss(model, ids, attn, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log and cfg.log_every and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps):
            log(f"warm start step {step + 1}/{cfg.steps}: loss {losses[-1]:.3f}")

    summary = {
        "base_model": os.path.abspath(model_path) if os.path.isdir(model_path) else model_path,
        "examples": len(encoded),
        "config": asdict(cfg),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": [round(x, 5) for x in losses],
        "seconds": round(time.time() - started, 2),
    }
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        model.eval()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return summary
