"""GPU probe of packed forwards (no pytest, no FSDP): packed vs padded ``PolicyLM`` on one CUDA
device, for the machines the CPU test suite cannot cover.

For each dtype (bf16: torch's FlashAttention varlen kernel; float32: the per-sequence sdpa
fallback) it builds a small random Qwen2 (GQA, head_dim 64), a batch with very uneven rows (a
1-token prompt with a 1-token response, full-length rows, an empty response) and prints one JSON
line: the largest log-prob difference and the relative gradient difference between the packed
and the padded forward, and how many times the varlen kernel ran (0 = the fallback ran).

    python tests/gpu/packing_check.py
"""

from __future__ import annotations

import functools
import json

import torch

from ppoflow.workers.modeling import PolicyLM
from ppoflow.workers.packing import use_varlen_attention

P, R, ROWS = 96, 64, 12


def batch(vocab: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    p_len = torch.randint(1, P + 1, (ROWS,), generator=g)
    r_len = torch.randint(0, R + 1, (ROWS,), generator=g)
    p_len[0], r_len[0] = 1, 1
    p_len[1], r_len[1] = P, R
    r_len[2] = 0
    col = torch.arange(P + R)
    attn = ((col >= P - p_len[:, None]) & (col < P + r_len[:, None])).long()
    ids = torch.randint(0, vocab, (ROWS, P + R), generator=g) * attn
    out = {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, P:].clone(),
        "response_mask": attn[:, P:].clone(),
    }
    return {k: v.to(device) for k, v in out.items()}


def run(dtype: torch.dtype) -> dict:
    import torch.nn.attention.varlen as varlen
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
    )
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg).to("cuda", dtype)
    data = batch(cfg.vocab_size, "cuda")
    results = {}
    calls = {"n": 0}
    kernel = varlen.varlen_attn

    @functools.wraps(kernel)  # keeps the signature the packing module inspects
    def counting(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    varlen.varlen_attn = counting
    try:
        for packed in (False, True):
            if packed:
                use_varlen_attention(hf)
                from ppoflow.workers import attention

                attention._varlen_kernel.cache_clear()
            model = PolicyLM(hf, chunk_size=256)
            model.zero_grad(set_to_none=True)
            out = model(**data, temperature=1.0, with_entropy=True, packed=packed)
            mask = data["response_mask"].bool()
            (out["log_probs"][mask].sum() + 0.1 * out["entropy"][mask].sum()).backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            results[packed] = (out["log_probs"].detach().float(), grads)
    finally:
        varlen.varlen_attn = kernel
    mask = data["response_mask"].bool()
    (lp0, g0), (lp1, g1) = results[False], results[True]
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "max_logprob_diff": float((lp1 - lp0)[mask].abs().max()),
        "logprob_scale": float(lp0[mask].abs().mean()),
        "grad_rel_diff": float((g1 - g0).norm() / g0.norm()),
        "varlen_kernel_calls": calls["n"],
        "real_tokens": int(data["attention_mask"].sum()),
        "positions": data["attention_mask"].numel(),
        "torch": torch.__version__,
    }


def main() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        print("PACKING_PROBE " + json.dumps(run(dtype)), flush=True)


if __name__ == "__main__":
    main()
