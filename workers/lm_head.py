"""The LM head of the policy: per-token log-probs (and entropy) from final hidden states, a chunk
of tokens at a time, never the whole (tokens, vocab) logits tensor.

    lp, ent = chunked_log_probs(hidden, lm_head, labels, temperature, with_entropy=True, impl="fused")

Implementations (``impl``): ``checkpoint`` runs each chunk under activation checkpointing;
``fused`` has a hand-written backward (saves the chunk's inputs and log-sum-exp, rebuilds the
softmax from one logits matmul). ``compiled=True`` runs the fused head's elementwise and reduction
work (float cast, temperature, log-sum-exp, gather, entropy; the softmax gradient) as
``torch.compile`` kernels: a few passes over the (chunk, vocab) logits instead of about a dozen;
the two matmuls stay cuBLAS's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["chunked_log_probs", "HEAD_IMPLS", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 1024
HEAD_IMPLS = ("checkpoint", "fused")


def _token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of ``labels`` (and entropy) under ``softmax((hidden @ weight.T + bias) / T)``.

    Args:
        hidden: (N, H) final hidden states.
        weight: (V, H) output embedding; bias: (V,) or None.
        labels: (N,) token ids.

    Returns:
        ``(log_probs (N,), entropy (N,))`` in float32; entropy is empty (0,) if not asked for.
    """
    logits = F.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return log_probs, logits.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs = torch.exp(logits - lse.unsqueeze(-1))
        entropy = lse - (probs * logits).sum(dim=-1)
    return log_probs, entropy


class _FusedHeadLogProb(torch.autograd.Function):
    """``_token_stats`` with a hand-written backward: saves only the chunk's inputs and its
    log-sum-exp (N,), and backward rebuilds the softmax in place from one logits matmul. Unlike
    checkpointing, backward never re-runs the entropy or autograd's log-softmax graph: fewer passes
    over the (N, V) block, which is what bounds the LM head on a GPU."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, entropy_grad, compiled=False):
        ctx.compiled = compiled
        if compiled:
            with torch.no_grad():
                logits = F.linear(hidden, weight, bias)
                log_probs, lse, entropy = _compiled()[0](logits, labels.long(), temperature, with_entropy)
        else:
            log_probs, lse, entropy = _FusedHeadLogProb._stats(
                hidden, weight, bias, labels, temperature, with_entropy
            )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy if entropy_grad else None)
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad and with_entropy
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def _stats(hidden, weight, bias, labels, temperature, with_entropy):
        """Eager forward math, in place on the one (N, V) float32 block."""
        with torch.no_grad():
            logits = F.linear(hidden, weight, bias).float()
            if temperature != 1.0:
                logits.div_(temperature)
            lse = torch.logsumexp(logits, dim=-1)
            log_probs = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - lse
            entropy = logits.new_zeros(0)
            if with_entropy:
                entropy = lse - (torch.exp(logits - lse.unsqueeze(-1)) * logits).sum(dim=-1)
        return log_probs, lse, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        with_ent_grad = ctx.entropy_grad and grad_ent is not None and grad_ent.numel()
        if ctx.compiled:
            grad_raw = _compiled()[1](
                F.linear(hidden, weight, bias),
                labels.long(),
                lse,
                entropy if with_ent_grad else lse,
                grad_lp,
                grad_ent if with_ent_grad else grad_lp,
                ctx.temperature,
                bool(with_ent_grad),
            )
        else:
            grad_raw = _FusedHeadLogProb._grad(
                ctx, hidden, weight, bias, labels, lse, entropy, grad_lp, grad_ent
            )
        grad_hidden = grad_raw @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_raw.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = grad_raw.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None

    @staticmethod
    def _grad(ctx, hidden, weight, bias, labels, lse, entropy, grad_lp, grad_ent):
        """Eager backward math: the (N, V) gradient of the raw logits, in place on one block."""
        z = F.linear(hidden, weight, bias).float()  # (N, V) scaled logits
        if ctx.temperature != 1.0:
            z.div_(ctx.temperature)
        probs = torch.exp(z - lse.unsqueeze(-1))
        # d log p(y) / dz = onehot(y) - p;  dH / dz = -p * (z - sum(p z)),  sum(p z) = lse - H
        if ctx.entropy_grad and grad_ent is not None and grad_ent.numel():
            grad_z = z.sub_((lse - entropy).unsqueeze(-1)).mul_(probs).mul_(-grad_ent.unsqueeze(-1))
            grad_z.sub_(probs.mul_(grad_lp.unsqueeze(-1)))
        else:
            grad_z = probs.mul_(-grad_lp.unsqueeze(-1))
        grad_z.scatter_add_(-1, labels.long().unsqueeze(-1), grad_lp.unsqueeze(-1).to(grad_z.dtype))
        if ctx.temperature != 1.0:
            grad_z.div_(ctx.temperature)
        return grad_z.to(hidden.dtype)


def _stats_math(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """(log-probs, log-sum-exp, entropy or empty) of (N, V) logits of any dtype, in float32; out of
    place, for ``torch.compile`` to fuse into a few reductions."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - (torch.exp(z - lse.unsqueeze(-1)) * z).sum(-1) if with_entropy else z.new_zeros(0)
    return log_probs, lse, entropy


def _grad_math(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_lp: torch.Tensor,
    grad_ent: torch.Tensor,
    temperature: float,
    entropy_grad: bool,
) -> torch.Tensor:
    """Gradient of the raw logits (N, V), in the logits' dtype: one pointwise pass (the one-hot of
    the labels from an iota compare, not a scatter), for ``torch.compile``."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    probs = torch.exp(z - lse.unsqueeze(-1))
    onehot = torch.arange(z.shape[-1], device=z.device).unsqueeze(0) == labels.unsqueeze(-1)
    grad_z = (onehot.float() - probs) * grad_lp.unsqueeze(-1)
    if entropy_grad:
        grad_z = grad_z - probs * (z - (lse - entropy).unsqueeze(-1)) * grad_ent.unsqueeze(-1)
    if temperature != 1.0:
        grad_z = grad_z / temperature
    return grad_z.to(logits.dtype)


_COMPILED: list = []


def _compiled():
    """``(_stats_math, _grad_math)`` compiled once per process (dynamic in the chunk's length)."""
    if not _COMPILED:
        _COMPILED.extend(torch.compile(fn, dynamic=True) for fn in (_stats_math, _grad_math))
    return _COMPILED


def chunked_log_probs(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
    impl: str = "checkpoint",
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) through ``head``, ``chunk_size`` tokens at a time.

    Peak extra memory is one (chunk_size, V) float32 logits block. Under autograd only a chunk's
    inputs are kept and backward recomputes its logits: ``impl="checkpoint"`` (default) runs the
    chunk under non-reentrant activation checkpointing; ``"fused"`` uses a hand-written backward
    (``_FusedHeadLogProb``; same numbers, fewer passes over the logits).

    Args:
        hidden: (N, H); head: the LM head (``weight`` (V, H), optional ``bias``); labels: (N,).
        entropy_grad: let gradients flow through the entropy (needed for an entropy bonus).
        compiled: the elementwise math of the fused head and of no-grad passes as
            ``torch.compile`` kernels (``impl="checkpoint"`` with gradients stays eager).

    Returns:
        ``(log_probs (N,), entropy (N,) or None)``, float32.
    """
    if impl not in HEAD_IMPLS:
        raise ValueError(f"unknown head impl {impl!r}; allowed: {', '.join(HEAD_IMPLS)}")
    outs_lp, outs_ent = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    # an empty input still runs one (empty) chunk: the outputs stay connected to the graph, so a
    # micro-batch without response tokens still runs backward (FSDP's collectives need every rank's)
    for start in range(0, max(hidden.shape[0], 1), chunk_size):
        args = (
            hidden[start : start + chunk_size],
            head.weight,
            head.bias,
            labels[start : start + chunk_size],
            temperature,
            with_entropy,
            entropy_grad,
        )
        if not grad and compiled:
            with torch.no_grad():
                logits = F.linear(args[0], head.weight, head.bias)
                lp, _, ent = _compiled()[0](logits, args[3].long(), temperature, with_entropy)
        elif not grad:
            lp, ent = _token_stats(*args)
        elif impl == "fused":
            lp, ent = _FusedHeadLogProb.apply(*args, compiled)
        else:
            lp, ent = checkpoint(_token_stats, *args, use_reentrant=False)
        outs_lp.append(lp)
        outs_ent.append(ent)
    return torch.cat(outs_lp), (torch.cat(outs_ent) if with_entropy else None)
