"""Sequence parallelism (Ulysses) for the packed forwards of the actor, reference and critic: the
tokens of one packed micro-batch split across the ``sp`` ranks of a group, attention computed
over whole sequences by trading the token split for a head split.

    sp = SequenceParallel.build(size=2)                    # collective: every rank of the world
    hidden, lo = sp.packed_hidden(base, pack(...))          # this rank's tokens [lo, lo + len)
    full = sp.gather(values_of_my_tokens, mine)             # (N,) on every rank of the group

Layout. The world is a ``("dp", "sp")`` device mesh of ``world / sp`` groups of ``sp``
consecutive ranks. The ranks of a group get the same rows (the worker sets ``dp_rank = rank //
sp``, ``dp_size = world / sp``); FSDP2 still shards the parameters over the whole world (its own
mesh, plain or hybrid): a parameter is gathered for a layer's forward whichever rows a rank holds,
and the gradients of a group's ranks are partial sums that FSDP's reduce-scatter adds together
with the other groups'. Sharding over every rank keeps the parameter, gradient and optimizer
memory per rank that the same world without SP has.

One forward (``packed_hidden``). The packed row of T real tokens is padded to a multiple of sp
(the padding is a segment of its own, never read) and rank r runs the embedding, every norm, MLP
and projection on its contiguous slice of T/sp tokens, with their own ``position_ids`` (they
restart per sequence: rotary embeddings need nothing else). Attention needs every earlier token
of a sequence, which may sit on other ranks: Ulysses' all-to-all turns the (T/sp tokens, H
heads) slices into (T tokens, H/sp heads) slices, the packed varlen attention of
``ppoflow.workers.packing`` runs unchanged on whole sequences for its heads (``cu_seqlens`` of
the whole packed row), and a second all-to-all turns the result back into token slices.

Why Ulysses and not ring attention:
- the attention kernel stays the packed varlen one (FlashAttention varlen on GPU, SDPA per
  sequence on CPU) with the whole row's ``cu_seqlens``: packing, restarting ``position_ids`` and
  causal masking need no change. A ring passes key/value blocks around and merges partial
  softmaxes (needs the kernel's log-sum-exp, which torch's varlen entry point does not return),
  and with packed segments every (query block, key block) pair has its own mask; causal masking
  also leaves the ranks unevenly loaded unless the tokens are reordered (zig-zag), which a packed
  row of ragged sequences makes awkward;
- the HF models stay HF: the all-to-all lives inside the attention function transformers calls
  (``AttentionInterface``), so Qwen2, Llama and every model that dispatches its attention there
  work without a patched class;
- communication: two all-to-alls of q/k/v/o per layer, ``O(T·H·D / sp)`` per rank, constant as sp
  grows with T; enough at the 2–8 ranks of one host (NVLink) that sequence parallelism targets here.
Its limit is the head count: sp must split the heads. Where sp does not divide them (SmolLM2: 9
query / 3 key-value heads at sp=2) the query heads are padded with zero heads up to a multiple
of sp (their outputs are discarded), and with grouped-query attention whose key/value heads sp
does not divide, the key/value heads are first repeated to one per query head; exact, at the cost
of some extra attention FLOPs and traffic (reported by ``head_layout``).

Outputs. The LM head (``ppoflow.workers.lm_head``, chunked) and the value head run on a rank's
own tokens only; ``gather`` then sums the ranks' disjoint contributions with an all-reduce so
every rank of the group holds the (N,) log-probs/values of the whole micro-batch, and runs the
unchanged loss on them. Its backward is an all-reduce too (the adjoint of "every rank computes
the same loss from the same sum"): each rank of a group back-propagates sp times the loss's
gradient through its own tokens, and the gradient accumulation of ``ppoflow.workers.minibatch``,
which counts each of the group's identical rows sp times in its global totals, divides it back.
So the step equals the step on the unsplit batch (the tests compare them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ppoflow.infra.data.dataproto import DataProto
    from ppoflow.workers.packing import Packed

__all__ = ["SequenceParallel", "head_layout", "check_sequence_parallel"]

# The attention core of a packed row: (q (1, H, T, D), k, v (1, Hkv, T, D), cu_seqlens, max_len,
# scaling) -> (1, T, H, D).
PackedAttention = Callable[..., torch.Tensor]


def check_sequence_parallel(size: int, world_size: int, section: str) -> None:
    """ValueError unless ``size`` (``<section>.sequence_parallel_size``) divides the world."""
    if size < 1 or world_size % size:
        raise ValueError(
            f"{section}.sequence_parallel_size={size} must divide the number of ranks {world_size}"
        )


def head_layout(num_heads: int, num_kv_heads: int, sp: int) -> dict[str, int | bool]:
    """How Ulysses splits the heads over ``sp`` ranks: query heads per rank (after padding to a
    multiple of sp), whether key/value heads are repeated to one per query head (grouped-query
    attention whose key/value heads sp does not divide), key/value heads per rank."""
    padded = math.ceil(num_heads / sp) * sp
    expand = num_kv_heads % sp != 0 or padded != num_heads
    kv = padded if expand else num_kv_heads
    return {
        "q_heads_per_rank": padded // sp,
        "kv_heads_per_rank": kv // sp,
        "padded_heads": padded - num_heads,
        "kv_repeated": expand and num_kv_heads != num_heads,
    }


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` on dim 0 of a (sp, ...) tensor; backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # empty_like keeps a view's strides: the output must be contiguous too
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _AllReduce(torch.autograd.Function):
    """Sum over the group; backward sums the gradients too (every rank uses the result)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


@dataclass
class SequenceParallel:
    """One rank's place in the ``("dp", "sp")`` layout, and the Ulysses collectives of its group.

    Attributes: ``size`` (sp), ``rank`` (in the group), ``group`` (its process group; None when
    size is 1), ``dp_rank``/``dp_size`` (which rows the group gets), ``mesh`` (the 2-D mesh).
    """

    size: int
    rank: int
    dp_rank: int
    dp_size: int
    group: Any = None
    mesh: Any = None

    @classmethod
    def build(cls, size: int, device_type: str = "cpu", section: str = "actor") -> SequenceParallel:
        """The layout of this rank for ``size`` (collective over the world when size > 1: every
        rank builds the mesh). Without torch.distributed, size must be 1."""
        initialized = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if initialized else (1, 0)
        check_sequence_parallel(size, world, section)
        if size == 1:
            return cls(size=1, rank=0, dp_rank=rank, dp_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "sp"))
        return cls(
            size=size,
            rank=rank % size,
            dp_rank=rank // size,
            dp_size=world // size,
            group=mesh["sp"].get_group(),
            mesh=mesh,
        )

    @property
    def on(self) -> bool:
        return self.size > 1

    def describe(self, config: Any = None) -> dict[str, Any]:
        """JSON summary (init_model's): sizes, and the head split for an HF ``config``."""
        info: dict[str, Any] = {"sp_size": self.size, "sp_rank": self.rank, "dp_size": self.dp_size}
        if config is not None and self.on:
            heads = config.num_attention_heads
            info.update(head_layout(heads, getattr(config, "num_key_value_heads", None) or heads, self.size))
        return info

    # ------------------------------------------------------------------ the forward
    def bounds(self, num_tokens: int) -> tuple[int, int, int]:
        """``(padded length, lo, hi)``: the packed row padded to a multiple of sp and this rank's slice."""
        padded = math.ceil(max(num_tokens, 1) / self.size) * self.size
        share = padded // self.size
        return padded, self.rank * share, (self.rank + 1) * share

    def packed_hidden(self, base: nn.Module, packed: Packed) -> tuple[torch.Tensor, int]:
        """Final hidden states of this rank's tokens of a packed row, ``(T/sp, H)``, and the
        packed-row index of the first one. Collective over the group (every rank, same row)."""
        from ppoflow.workers.packing import VARLEN_ATTENTION

        impl = getattr(base.config, "_attn_implementation", None)
        if impl != VARLEN_ATTENTION:
            raise RuntimeError(
                f"a sequence-parallel forward needs the attention implementation {VARLEN_ATTENTION!r}, "
                f"the model has {impl!r} (build it with use_dynamic_bsz)"
            )
        t = packed.num_tokens
        padded, lo, hi = self.bounds(t)
        ids = F.pad(packed.input_ids, (0, padded - t))
        pos = F.pad(packed.position_ids, (0, padded - t))
        cu, max_len = packed.cu_seqlens, packed.max_len
        if padded > t:  # the padding: a segment of its own at the end
            cu = torch.cat([cu, cu.new_tensor([padded])])
            max_len = max(max_len, padded - t)
        out = base(
            input_ids=ids[:, lo:hi],
            position_ids=pos[:, lo:hi],
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max_len,
            max_length_k=max_len,
            ppoflow_sp=self,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden[0], lo

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(1, H, T/sp, D) token slice of all heads -> (1, H/sp, T, D) all tokens of this rank's heads."""
        _, h, tl, d = x.shape
        parts = _AllToAll.apply(x[0].reshape(self.size, h // self.size, tl, d), self.group)
        return parts.permute(1, 0, 2, 3).reshape(1, h // self.size, self.size * tl, d)

    def _to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, H/sp, D) -> (1, T/sp, H, D): back to this rank's tokens, every head."""
        _, t, h, d = x.shape
        parts = _AllToAll.apply(x[0].reshape(self.size, t // self.size, h, d), self.group)
        return parts.permute(1, 0, 2, 3).reshape(1, t // self.size, self.size * h, d)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        scaling: float | None,
        core: PackedAttention,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Ulysses attention: query (1, Hq, T/sp, D), key/value (1, Hkv, T/sp, D) of this rank's
        tokens -> (1, T/sp, Hq, D), each token attending to the earlier tokens of its sequence
        (segments ``cu_seqlens`` of the whole padded row) through ``core`` on H/sp heads; ``sinks``
        (Hq,): attention sinks, this rank's heads' share passed to ``core``."""
        heads, kv_heads = query.shape[1], key.shape[1]
        layout = head_layout(heads, kv_heads, self.size)
        if layout["padded_heads"] or kv_heads % self.size:
            if kv_heads != heads:  # one key/value head per query head
                key = key.repeat_interleave(heads // kv_heads, dim=1)
                value = value.repeat_interleave(heads // kv_heads, dim=1)
            pad = (0, 0, 0, 0, 0, int(layout["padded_heads"]))
            query, key, value = (F.pad(t, pad) for t in (query, key, value))
        q, k, v = (self._to_heads(t) for t in (query, key, value))
        extra = {}
        if sinks is not None:  # heads are split in consecutive blocks (_to_heads)
            share = int(layout["q_heads_per_rank"])
            extra["sinks"] = F.pad(sinks, (0, int(layout["padded_heads"])))[
                self.rank * share : (self.rank + 1) * share
            ]
        out = core(q, k, v, cu_seqlens, max_len, scaling, **extra)  # (1, T, H/sp, D)
        return self._to_tokens(out)[:, :, :heads]

    # ------------------------------------------------------------------ outputs
    def gather(self, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
        """(N, ...) on every rank of the group from each rank's values at its own positions:
        ``local`` holds the values where the (N,) bool ``mine`` is true (disjoint across ranks).
        Differentiable (backward: an all-reduce, see the module docstring)."""
        full = local.new_zeros((mine.shape[0], *local.shape[1:]))
        full = full.index_put((mine.nonzero().squeeze(-1),), local)
        if not self.on:
            return full
        if torch.is_grad_enabled() and full.requires_grad:
            return _AllReduce.apply(full, self.group)
        dist.all_reduce(full, group=self.group)
        return full

    def gather_proto(self, data: DataProto) -> DataProto:
        """The group's DataProtos concatenated in sp-rank order, on every rank of the group, sent
        as their Arrow IPC files (no pickle). ``meta_info`` is sp rank 0's."""
        import fsspec

        from ppoflow.infra.data.dataproto import DataProto

        if not self.on:
            return data
        fs = fsspec.filesystem("memory")
        url = f"memory://ppoflow-sp-gather/{dist.get_rank()}.arrow"
        data.save(url)
        with fs.open(url, "rb") as f:
            raw = f.read()
        fs.rm(url)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" else None
        )
        payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device or "cpu")
        sizes = [torch.zeros(1, dtype=torch.int64, device=payload.device) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], device=payload.device), group=self.group)
        longest = int(max(int(s.item()) for s in sizes))
        buffers = [torch.empty(longest, dtype=torch.uint8, device=payload.device) for _ in range(self.size)]
        dist.all_gather(buffers, F.pad(payload, (0, longest - payload.numel())), group=self.group)
        parts = []
        for j, (size, buf) in enumerate(zip(sizes, buffers)):
            part_url = f"memory://ppoflow-sp-gather/{dist.get_rank()}-from-{j}.arrow"
            with fs.open(part_url, "wb") as f:
                f.write(buf[: int(size.item())].cpu().numpy().tobytes())
            parts.append(DataProto.load(part_url))
            fs.rm(part_url)
        merged = DataProto.concat(parts)
        merged.meta_info = parts[0].meta_info
        return merged
