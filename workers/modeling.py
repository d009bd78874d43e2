"""FSDP root modules around Hugging Face models: per-token log-probs for the policy, per-token
values for the critic, computed only on the response positions.

Both wrappers hold the HF model's own children under their HF attribute names (``model``,
``lm_head``, ``score``), so ``named_parameters()`` gives exactly the names of the HF checkpoint
(and of vLLM's weight loader): ``model.layers.0.self_attn.q_proj.weight``, ... They are meant to be
the FSDP root: the root owns the embeddings, final norm and the (tied) head.

Layout of a batch (docs/internals.md): ``input_ids`` (B, P+R) = left-padded prompt + right-padded
response; the hidden state at position ``P+t-1`` predicts response token ``t``, so
``hidden[:, -R-1:-1]`` lines up with ``responses`` (B, R).

With ``packed=True`` the padding is dropped before the model runs: the real tokens of the
micro-batch go through it as one row (``ppoflow.workers.packing``; the HF model must use the
``ppoflow_varlen`` attention) and only the states the outputs need are gathered from it.

With a ``sequence_parallel`` layout of size sp > 1 (``ppoflow.workers.sequence_parallel``) a
packed forward is split across the ranks of the group: each runs the model and the head on its
1/sp of the packed row's tokens, and the (N,) outputs are gathered so every rank of the group
returns the whole micro-batch's. Padded forwards are not split (they raise).

The policy never builds the (B, T, V) logits tensor: log-probs (and entropy) come from the final
hidden states in chunks of ``chunk_size`` tokens; with gradients enabled each chunk runs under
activation checkpointing, so backward recomputes that chunk's logits instead of keeping them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ppoflow.workers.lm_head import DEFAULT_CHUNK, HEAD_IMPLS, chunked_log_probs
from ppoflow.workers.packing import checked_index, pack, packed_hidden

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ppoflow.workers.sequence_parallel import SequenceParallel

__all__ = ["HFRoot", "PolicyLM", "ValueModel", "base_hidden", "one_label", "chunked_log_probs", "HEAD_IMPLS"]


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place (N,) values at the N true positions of a (B, R) bool mask; zeros elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def base_hidden(
    base: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Final hidden states (B, T, H) of the HF base model on a padded batch (no KV cache)."""
    out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _response_hidden(
    base: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """Final hidden states that predict each response token: (B, R, H)."""
    return base_hidden(base, input_ids, attention_mask, position_ids)[:, -response_length - 1 : -1]


def _masked_response_hidden(
    base: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    packed: bool,
) -> torch.Tensor:
    """(N, H): the hidden states predicting the N response tokens where the (B, R) bool ``mask``
    is true, from a padded forward or from a packed one (no compute on padding)."""
    if not packed:
        return _response_hidden(base, input_ids, attention_mask, position_ids, mask.shape[1])[mask]
    rows = pack(input_ids, attention_mask, position_ids)
    index = rows.index[:, -mask.shape[1] - 1 : -1][mask]
    return packed_hidden(base, rows)[checked_index(index, "the state before a response token")]


def _split_response_hidden(
    base: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    mask: torch.Tensor,
    sp: SequenceParallel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence parallel: ``(hidden (n, H), mine (N,) bool)``: of the N states predicting the
    response tokens where ``mask`` is true, the n that lie in this rank's slice of the packed row
    (``mine`` marks which); collective over the sp group."""
    rows = pack(input_ids, attention_mask, position_ids)
    index = checked_index(rows.index[:, -mask.shape[1] - 1 : -1][mask], "the state before a response token")
    hidden, lo = sp.packed_hidden(base, rows)
    mine = (index >= lo) & (index < lo + hidden.shape[0])
    return hidden[index[mine] - lo], mine


def _no_padded_split(sp: SequenceParallel | None, packed: bool) -> bool:
    """Whether this forward is split across an sp group; ValueError for a padded one that should be."""
    if sp is None or not sp.on:
        return False
    if not packed:
        raise ValueError(
            "sequence parallelism splits packed micro-batches only: set use_dynamic_bsz=true "
            "(and the reference's log_prob_use_dynamic_bsz) with sequence_parallel_size > 1"
        )
    return True


def one_label(hf_model: PreTrainedModel, role: str) -> None:
    """ValueError unless the HF model has a one-label head (``role`` names the model in it)."""
    if getattr(hf_model.config, "num_labels", 1) != 1:
        raise ValueError(f"{role} needs num_labels=1, got {hf_model.config.num_labels}")


class HFRoot(nn.Module):
    """What the FSDP roots around an HF model share: the HF base model registered under its own
    attribute name (``base_model_prefix``: ``model``, ...), so parameter names are the HF names,
    the HF config, and the HF model object itself kept unregistered in ``hf_model`` (its head and
    ``generate``; registering it would add its parameters twice under other names). A subclass
    registers its head after ``HFRoot.__init__``, as the HF model orders its parameters."""

    hf_key_prefix = ""  # parameter names already are HF names (for ppoflow.infra.checkpoint.sharded)
    hf_model: PreTrainedModel  # set with object.__setattr__ (unregistered)

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        self.base_prefix = hf_model.base_model_prefix
        setattr(self, self.base_prefix, getattr(hf_model, self.base_prefix))
        self.config = hf_model.config
        object.__setattr__(self, "hf_model", hf_model)

    @property
    def base(self) -> nn.Module:
        return getattr(self, self.base_prefix)


class PolicyLM(HFRoot):
    """Causal LM wrapper whose forward gives the log-probs of the response tokens.

    Holds the HF model's base (``model``) and output embedding (``lm_head``) as children; the HF
    model object itself is kept unregistered in ``hf_model`` (for ``generate`` and its config).
    Only plain linear heads are supported (no logit soft-capping / scaling). ``compiled_head``:
    the fused head's elementwise math as ``torch.compile`` kernels (``ppoflow.workers.lm_head``).
    """

    def __init__(
        self,
        hf_model: PreTrainedModel,
        chunk_size: int = DEFAULT_CHUNK,
        head_impl: str = "checkpoint",
        compiled_head: bool = False,
        sequence_parallel: SequenceParallel | None = None,
    ):
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(hf_model.config, attr, None) not in (None, 1.0):
                raise NotImplementedError(f"{type(hf_model).__name__} uses {attr}: not supported by PolicyLM")
        super().__init__(hf_model)
        self.lm_head = hf_model.get_output_embeddings()
        self.chunk_size, self.head_impl, self.compiled_head = chunk_size, head_impl, compiled_head
        self.sequence_parallel = sequence_parallel

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        responses: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        packed: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Log-probs of ``responses`` given the prefix, with temperature.

        Args:
            input_ids, attention_mask, position_ids: (B, P+R).
            responses: (B, R), the last R columns of ``input_ids``.
            response_mask: (B, R); if given, only those tokens are computed (zeros elsewhere).
            packed: run the model on the real tokens only (same numbers up to float rounding).

        Returns:
            ``{"log_probs": (B, R)}`` (+ ``"entropy": (B, R)`` with ``with_entropy``), float32.
        """
        mask = torch.ones_like(responses, dtype=torch.bool) if response_mask is None else response_mask.bool()
        sp = self.sequence_parallel
        labels = responses[mask]
        split = _no_padded_split(sp, packed)
        if split:
            assert sp is not None
            hidden, mine = _split_response_hidden(
                self.base, input_ids, attention_mask, position_ids, mask, sp
            )
            labels = labels[mine]
        else:
            hidden = _masked_response_hidden(self.base, input_ids, attention_mask, position_ids, mask, packed)
        lp, ent = chunked_log_probs(
            hidden,
            self.lm_head,
            labels,
            temperature,
            with_entropy,
            entropy_grad,
            self.chunk_size,
            self.head_impl,
            self.compiled_head,
        )
        if split:  # sequence parallel: every rank of the group gets the whole micro-batch's
            assert sp is not None
            both = sp.gather(torch.stack([lp, ent], -1) if ent is not None else lp.unsqueeze(-1), mine)
            lp, ent = both[:, 0], (both[:, 1] if ent is not None else None)
        out = {"log_probs": _scatter(lp, mask)}
        if with_entropy:
            assert ent is not None  # chunked_log_probs computes it with with_entropy
            out["entropy"] = _scatter(ent, mask)
        return out


class ValueModel(HFRoot):
    """Critic wrapper around an HF token-classification model with one label.

    ``forward`` returns (B, R) values on the response positions: ``values[:, t] = V(s_t)``, the
    value of the state just before response token ``t`` (hidden state at position ``P+t-1``).
    The head's dropout is not applied (the critic is deterministic).
    """

    def __init__(self, hf_model: PreTrainedModel, sequence_parallel: SequenceParallel | None = None):
        one_label(hf_model, "a critic")
        head_name = next(
            (n for n in ("score", "classifier") if isinstance(getattr(hf_model, n, None), nn.Module)), None
        )
        if head_name is None:
            raise TypeError(
                f"{type(hf_model).__name__} has no token-classification head (score / classifier)"
            )
        super().__init__(hf_model)
        self.head_name = head_name
        setattr(self, head_name, getattr(hf_model, head_name))
        self.sequence_parallel = sequence_parallel

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        response_mask: torch.Tensor | None = None,
        packed: bool = False,
    ) -> torch.Tensor:
        """Values (B, R), float32, for every response position (mask them downstream).

        With ``packed`` the model runs on the real tokens only and values are computed where
        ``response_mask`` (default: the response part of ``attention_mask``) is set, 0 elsewhere.
        """
        head = getattr(self, self.head_name)
        sp = self.sequence_parallel
        if _no_padded_split(sp, packed):
            assert sp is not None
            mask = attention_mask[:, -response_length:] if response_mask is None else response_mask
            mask = mask.bool()
            hidden, mine = _split_response_hidden(
                self.base, input_ids, attention_mask, position_ids, mask, sp
            )
            return _scatter(sp.gather(head(hidden).squeeze(-1).float(), mine), mask)
        if not packed:
            hidden = _response_hidden(self.base, input_ids, attention_mask, position_ids, response_length)
            return head(hidden).squeeze(-1).float()
        mask = attention_mask[:, -response_length:] if response_mask is None else response_mask
        mask = mask.bool()
        hidden = _masked_response_hidden(self.base, input_ids, attention_mask, position_ids, mask, True)
        return _scatter(head(hidden).squeeze(-1).float(), mask)
