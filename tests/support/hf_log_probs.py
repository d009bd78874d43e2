"""The reference for what a rollout's log-probs should be: a plain transformers forward."""

from __future__ import annotations

import torch

from ppoflow.infra.data.dataproto import DataProto


def response_log_probs(
    model_dir: str, batch: DataProto, temperature: float, weights: dict | None = None
) -> torch.Tensor:
    """(B, R) log-probs of ``batch``'s responses under the model at ``model_dir`` (float32), or under
    ``weights`` (a full state dict, e.g. a checkpoint's) loaded into it, at ``temperature``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    r = batch.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=batch.batch["input_ids"],
            attention_mask=batch.batch["attention_mask"],
            position_ids=batch.batch["position_ids"],
        ).logits[:, -r - 1 : -1]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
