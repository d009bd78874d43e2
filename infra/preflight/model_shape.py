"""A model's shape from its ``config.json`` (read as JSON: no weights, no torch, no transformers),
and what the memory plan counts from it: parameters, LoRA adapters, activations a token keeps.

    shape = read_shape(cfg.model)            # None when no config.json is readable here
    shape.params("lm"), shape.params("value") # the policy's and a critic's parameter counts

The fields read (a multimodal config's ``text_config`` first): ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``, and for mixtures of experts
``num_experts`` / ``num_local_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` and
``shared_expert_intermediate_size``; ``model.override_config`` is applied on top, as the
workers apply it. Every decoder layer is counted as gated (SwiGLU: gate, up and down
projections) with two norms; with experts every layer is a mixture-of-experts layer.

Activations (:meth:`ModelShape.saved_bytes_per_token`): what one decoder layer keeps of a token
for its backward, counted tensor by tensor in the compute dtype: the two norms' inputs and
outputs (4 x hidden), the attention's queries, keys and values and its output (2 x q + 2 x kv),
the MLP's gate, up and product (3 x intermediate; with experts, those of the experts a token is
routed to and of the shared expert), and the attention's log-sum-exp (fp32, one per head).
GPT-OSS's experts run as transformers' loop over the experts hit, outside the compiled graph (its
data-dependent expert selection breaks it), with a clamped SwiGLU and biases: per routed token they
keep the gathered input, the gate-up output (2 x), the clamped gate and up, the sigmoid, the GLU, the
product and the expert's output: ``2 x hidden + 7 x intermediate`` (:attr:`ModelShape.expert_loop`;
measured on one H100 at 24,576 tokens, docs/models.md: 45.1 GiB against 29.7 planned with
``3 x intermediate``, 45.6 with this count).
What a micro-batch holds per token scales that count by factors measured on GPUs
(:data:`ACTIVATION_SCALE`, by path: compiled, eager packed, eager padded; the caching allocator's
reserved peaks, so its fragmentation is in them; on CPU ranks, float32, a factor of its own):

- an update without recompute: every layer's, ``layers x count x scale``;
- with recompute (``model.enable_gradient_checkpointing``): each layer's input (``layers x hidden``
  in the compute dtype) and :data:`RECOMPUTE_LAYERS` layers' worth (the one recomputed, its backward);
- a forward without gradients (log-probs, values, scores): :data:`FORWARD_LAYERS` layers' worth.

Each adds :data:`HEAD_BYTES_PER_TOKEN`. docs/gpus.md ("Memory") has the measured figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from ppoflow.infra.config import LoRAConfig, ModelConfig
from ppoflow.infra.models.hf_hub import is_hub_id

__all__ = [
    "ModelShape",
    "read_shape",
    "shape_from_config",
    "activation_path",
    "activation_bytes_per_token",
    "forward_bytes_per_token",
    "DTYPE_BYTES",
    "LINEAR_NAMES",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: A decoder layer's linear layers (their names in Llama/Qwen/Mistral checkpoints), the ones
#: ``lora.target_modules: all-linear`` adapts.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: Activations a layer keeps per token, as multiples of :meth:`ModelShape.saved_bytes_per_token`,
#: by path: on GPUs measured at the Qwen2.5-0.5B shape with 24,576-token micro-batches on one H200
#: (bf16 compute: the eager paths keep fp32 copies in the norms); ``cpu``: float32 on CPU ranks,
#: packed or padded alike, measured at a 4-layer, 256-wide shape with 4,096-token micro-batches.
ACTIVATION_SCALE = {"compiled": 1.18, "eager": 2.52, "eager_padded": 1.64, "cpu": 1.47}
#: Under recompute: layers' worth of activations alive at once (the one recomputed and its
#: backward), beside every layer's input; GPUs: measured at 16k rows (33,792-token micro-batches),
#: CPU ranks at the shape and micro-batch of the ``cpu`` scale.
RECOMPUTE_LAYERS = {"gpu": 2.3, "cpu": 1.2}
#: A forward without gradients (log-probs, values, scores): layers' worth alive at once.
FORWARD_LAYERS = 1.53
#: Per token beside the layers: the final hidden state and its gradient, and a dozen fp32 columns.
HEAD_BYTES_PER_TOKEN = 64


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that decide its memory (module docstring)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    #: the experts run as an eager per-expert loop with a clamped, biased SwiGLU (GPT-OSS)
    expert_loop: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def _mlp_params(self) -> int:
        h = self.hidden
        if not self.experts:
            return 3 * h * self.intermediate
        routed = self.experts * 3 * h * self.expert_intermediate + h * self.experts
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return routed + shared

    def layer_params(self) -> int:
        """One decoder layer: attention (with q/k/v biases and q/k norms where the family has
        them: Qwen2, Qwen3), MLP, norms."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + self._mlp_params() + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def root_params(self, head: Literal["lm", "value"]) -> int:
        """What lies outside the layers: embeddings, final norm, and the head (an untied LM head,
        or a critic's value head ``hidden -> 1``)."""
        out = self.vocab * self.hidden + self.hidden
        if head == "value":
            return out + self.hidden + 1
        return out + (0 if self.tied else self.vocab * self.hidden)

    def params(self, head: Literal["lm", "value"] = "lm") -> int:
        """Every parameter of the policy (``lm``) or of a critic built on this base (``value``)."""
        return self.layers * self.layer_params() + self.root_params(head)

    def lora_params(self, lora: LoRAConfig) -> int:
        """The adapters' parameters: ``rank x (in + out)`` for each adapted linear of every layer
        (module names matched by suffix; with experts, the attention's only)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        sizes = {
            "q_proj": h + q,
            "k_proj": h + kv,
            "v_proj": h + kv,
            "o_proj": q + h,
            "gate_proj": 0 if self.experts else h + i,
            "up_proj": 0 if self.experts else h + i,
            "down_proj": 0 if self.experts else i + h,
        }
        wanted = lora.target_modules
        names = (
            LINEAR_NAMES
            if wanted == "all-linear"
            else [n for n in LINEAR_NAMES if any(w.split(".")[-1] == n for w in wanted)]
        )
        return self.layers * lora.rank * sum(sizes[n] for n in names)

    def saved_bytes_per_token(self, compute_bytes: int) -> int:
        """Bytes one decoder layer keeps of one token for the backward (module docstring)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        if not self.experts:
            mlp = 3 * self.intermediate
        else:
            per_route = (
                2 * h + 7 * self.expert_intermediate if self.expert_loop else 3 * self.expert_intermediate
            )
            mlp = self.experts_per_token * per_route + 3 * self.shared_intermediate
        router = 4 * self.experts  # the router's fp32 logits
        return compute_bytes * (4 * h + 2 * q + 2 * kv + mlp) + 4 * self.heads + router

    def kv_bytes_per_token(self, engine_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes of one token on one tensor-parallel rank (the engine replicates KV heads
        when there are fewer than ``tp``), as ``ppoflow.workers.rollout.vllm_engine`` sizes it."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * engine_bytes

    def engine_tensors(self) -> int:
        """Weight tensors the engine holds (fused qkv and gate-up, as vLLM loads them)."""
        per_layer = 7 + (3 if self.qkv_bias else 0) + (self.experts * 2 if self.experts else 0)
        return self.layers * per_layer + 2 + (0 if self.tied else 1)


def activation_path(device: str, compiled: bool, packed: bool) -> str:
    """The :data:`ACTIVATION_SCALE` entry of a model's forward on ``device``."""
    if device == "cpu":
        return "cpu"
    return "compiled" if compiled else "eager" if packed else "eager_padded"


def activation_bytes_per_token(shape: ModelShape, compute_bytes: int, path: str, recompute: bool) -> int:
    """Bytes an update keeps per token of its micro-batch on ``path`` (module docstring)."""
    layer = shape.saved_bytes_per_token(compute_bytes) * ACTIVATION_SCALE[path]
    if recompute:
        live = RECOMPUTE_LAYERS["cpu" if path == "cpu" else "gpu"]
        kept = shape.layers * compute_bytes * shape.hidden + live * layer
    else:
        kept = shape.layers * layer
    return int(kept) + HEAD_BYTES_PER_TOKEN


def forward_bytes_per_token(shape: ModelShape, compute_bytes: int, path: str) -> int:
    """Bytes a forward without gradients holds per token of its micro-batch (module docstring)."""
    layer = shape.saved_bytes_per_token(compute_bytes) * ACTIVATION_SCALE[path]
    return int(FORWARD_LAYERS * layer) + HEAD_BYTES_PER_TOKEN


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    """The shape of a ``config.json``'s dict (its ``text_config`` when it has one); KeyError names
    a field that is missing."""
    text = dict(config.get("text_config") or config)
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
    moe_i = text.get("moe_intermediate_size") or (text["intermediate_size"] if experts else 0)
    family = str(text.get("model_type", config.get("model_type", "")))
    return ModelShape(
        hidden=hidden,
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        intermediate=int(text.get("intermediate_size") or 4 * hidden),
        vocab=int(text["vocab_size"]),
        tied=bool(text.get("tie_word_embeddings", False)),
        qkv_bias=bool(text.get("attention_bias", family.startswith("qwen2"))),
        qk_norm=family.startswith("qwen3"),
        experts=experts,
        experts_per_token=int(text.get("num_experts_per_tok") or 0),
        expert_intermediate=int(moe_i),
        shared_intermediate=int(text.get("shared_expert_intermediate_size") or 0),
        expert_loop=family == "gpt_oss",
    )


def read_shape(model: ModelConfig) -> ModelShape | None:
    """The shape of ``model`` from its ``config.json`` (a local directory, or a hub id already in
    this machine's Hugging Face cache), with ``override_config`` applied; None where no
    ``config.json`` can be read here or it lacks a size (the preflight's model check says why)."""
    path: str | None = os.path.join(model.path, "config.json")
    if not os.path.isfile(path or "") and is_hub_id(model.path):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model.path, "config.json")
        path = found if isinstance(found, str) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
        config.update(model.override_config)
        return shape_from_config(config)
    except (OSError, ValueError, KeyError, TypeError):
        return None
