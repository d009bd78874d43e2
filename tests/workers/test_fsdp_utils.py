"""The FSDP2-sharded model's full parameters, streamed under the checkpoint's names."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


def test_full_params_carry_the_checkpoint_names(tiny):
    """iter_full_params (what the rollout's weight sync streams) names tensors as the HF checkpoint."""
    from safetensors.torch import load_file

    from ppoflow.infra.config import ModelConfig
    from ppoflow.workers.fsdp_utils import iter_full_params
    from ppoflow.workers.hf_models import load_hf_model
    from ppoflow.workers.modeling import PolicyLM

    stored = load_file(os.path.join(tiny["dir"], "model.safetensors"))
    streamed = dict(iter_full_params(PolicyLM(load_hf_model(ModelConfig(path=tiny["dir"]), "causal_lm"))))
    assert set(streamed) == set(stored)  # tied: no lm_head.weight, as in the checkpoint
    assert all(torch.equal(streamed[k], stored[k]) for k in stored)
