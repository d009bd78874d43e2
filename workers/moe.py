"""Router statistics of a mixture-of-experts policy: the load-balancing loss and how evenly each
layer's tokens spread over the experts, as the actor's update metrics.

    router = RouterStats.of(policy_module)        # None for a dense model
    with router.record() as logits:               # the routers' logits of one forward
        out = policy_module(...)
    metrics = router.metrics(logits, token_mask)  # actor/moe/aux_loss, load_max, load_min, load_entropy

The routers are found the way transformers finds them for ``output_router_logits``: the model's
``_can_record_outputs["router_logits"]`` names the router class and which of its outputs holds the
logits; a forward hook on each router module keeps them (per layer, tokens x experts). No extra
forward and nothing in the loss: ``aux_loss`` is transformers' own load-balancing loss
(``load_balancing_loss_func`` of the model's module, Switch Transformer's, before
``router_aux_loss_coef``) of the micro-batch's real tokens, reported, not trained on (ppoflow's
policy loss has no auxiliary term, as veRL's has none). ``load_max`` / ``load_min``: the largest and
smallest share of a layer's top-k assignments one expert got (1 / experts when balanced);
``load_entropy``: the entropy of those shares over log(experts), averaged over layers (1 when
balanced). With sequence parallelism each rank reports its own tokens (and the padding that makes
the packed row divisible, at most sp - 1 tokens).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["RouterStats", "MOE_METRICS"]

MOE_METRICS = ("actor/moe/aux_loss", "actor/moe/load_max", "actor/moe/load_min", "actor/moe/load_entropy")


def _recorder(hf_model: nn.Module) -> tuple[type, int] | None:
    """The router class and the index of its logits output, from ``_can_record_outputs``."""
    for module in hf_model.modules():
        spec = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is not None:
            return getattr(spec, "target_class", spec), int(getattr(spec, "index", 0) or 0)
    return None


class RouterStats:
    """The routers of one MoE model (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, router_class: type, index: int):
        config: Any = hf_model.config
        self.experts = int(getattr(config, "num_experts", None) or config.num_local_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.routers = [m for m in hf_model.modules() if isinstance(m, router_class)]
        self.index = index
        self.aux_loss = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)

    @classmethod
    def of(cls, module: nn.Module) -> RouterStats | None:
        """The stats of a policy (``PolicyLM`` or HF model); None when it has no routers."""
        hf = getattr(module, "hf_model", module)
        found = _recorder(hf)
        if found is None:
            return None
        stats = cls(hf, *found)
        return stats if stats.routers else None

    @contextlib.contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Keep every router's logits (detached) of the forwards inside the block, layer by layer."""
        logits: list[torch.Tensor] = []

        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            out = output[self.index] if isinstance(output, (tuple, list)) else output
            logits.append(out.detach().reshape(-1, out.shape[-1]))

        handles = [router.register_forward_hook(hook) for router in self.routers]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def metrics(self, logits: list[torch.Tensor], token_mask: torch.Tensor | None) -> dict[str, float]:
        """The ``actor/moe/*`` metrics of one forward's router logits; ``token_mask``: the (B, L)
        attention mask of a padded forward (None: every token is real, a packed forward)."""
        if not logits:
            return {}
        flat = None if token_mask is None else token_mask.reshape(-1).float().to(logits[0].device)
        shares = []
        for layer in logits:
            _, chosen = torch.topk(layer.float().softmax(-1), self.top_k, dim=-1)
            weights = torch.ones(chosen.shape[0], device=layer.device) if flat is None else flat
            counts = torch.zeros(self.experts, device=layer.device)
            counts.scatter_add_(0, chosen.reshape(-1), weights.repeat_interleave(self.top_k))
            shares.append(counts / counts.sum().clamp(min=1.0))
        share = torch.stack(shares)  # (layers, experts)
        entropy = -(share * share.clamp(min=1e-12).log()).sum(-1) / math.log(self.experts)
        out = {
            "actor/moe/load_max": float(share.max()),
            "actor/moe/load_min": float(share.min()),
            "actor/moe/load_entropy": float(entropy.mean()),
        }
        if self.aux_loss is not None:
            mask = None if token_mask is None else token_mask
            out["actor/moe/aux_loss"] = float(self.aux_loss(tuple(logits), self.experts, self.top_k, mask))
        return out
