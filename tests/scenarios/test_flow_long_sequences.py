"""Long responses through the flow with sequence parallelism: 2 CPU ranks as one sp group of 2
(actor, reference and critic), vLLM's CPU engine sampling responses of up to 2048 tokens from a
tiny model whose 4096-token vocabulary makes a stop token rare (most responses run to the limit),
packed micro-batches of at most one row split over the two ranks (each rank runs half of it:
a per-GPU budget of half a row), the chunked log-prob head in chunks of 256 tokens.

The iteration commits, the responses are long, and the FSDP policy's old log-probs, computed
split across the ranks, equal the engine's own log-probs of what it sampled (1e-4, the engine
and trainer agreement the other flow tests hold at 8 tokens).
"""

from __future__ import annotations

import pytest

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.experiment.manifest import ExperimentPaths, read_manifest

pytestmark = pytest.mark.slow

PROMPT, RESPONSE = 16, 2048
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from ppoflow.demo.tiny_models import build_char_tokenizer, tiny_config

    out = str(tmp_path_factory.mktemp("long-model"))
    tok = build_char_tokenizer()
    cfg = tiny_config(
        4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_position_embeddings=4096
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_sequence_parallel_iteration_with_2k_token_responses_commits(
    prefect_harness, flow_config, long_model, tmp_path
):
    from ppoflow.flows.ppo import ppo

    half_row = (PROMPT + RESPONSE) // 2
    cfg = flow_config(
        str(tmp_path),
        "long",
        **{
            "model.path": long_model,
            "reward.reward_model.enable": False,  # the tiny reward model has 512 positions
            "rollout.prompt_length": PROMPT,
            "rollout.response_length": RESPONSE,
            "rollout.kv_cache_gib": 0.05,
            "rollout.calculate_log_probs": True,
            "actor.use_dynamic_bsz": True,
            "actor.sequence_parallel_size": 2,
            "actor.ppo_max_token_len_per_gpu": half_row,
            "actor.log_prob_max_token_len_per_gpu": half_row,
            "actor.logprob_chunk_size": 256,
            "critic.use_dynamic_bsz": True,
            "critic.sequence_parallel_size": 2,
            "critic.ppo_max_token_len_per_gpu": half_row,
            "critic.forward_max_token_len_per_gpu": half_row,
            "model.enable_gradient_checkpointing": True,
        },
    )
    ppo(cfg, iterations=1)
    paths = ExperimentPaths(cfg.storage.experiment_url)
    assert read_manifest(paths).iteration == 1
    rollout = DataProto.load(paths.file(1, "rollout.arrow"))
    mask = rollout.batch["response_mask"].bool()
    lengths = mask.sum(-1)
    assert len(rollout) == 8 and int(lengths.max()) == RESPONSE and float(lengths.float().mean()) > 1000
    err = (rollout.batch["rollout_log_probs"] - rollout.batch["old_log_probs"])[mask].abs().max().item()
    print(f"\nlong sp flow: response lengths {lengths.tolist()}, engine vs split FSDP log-prob err {err:.2e}")
    assert err < LOGPROB_TOL, err
