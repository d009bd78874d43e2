"""What every rollout engine shares (``base``), without ranks or an engine: the sampling settings
of a call, the output batch built from token lists (right-padded responses, positions continuing
the prompt, non-tensor columns interleaved), the prompts refused early, the stop tokens, the
request seeds."""

from __future__ import annotations

import pytest
import torch

from ppoflow.workers.rollout.base import check_prompts, eos_token_ids, prompt_token_lists, request_seed
from tests.support.rollout.vllm_scenario import P, left_padded_prompts


def test_sampling_settings_resolve():
    from ppoflow.infra.config import RolloutConfig
    from ppoflow.workers.rollout.base import SamplingSettings

    cfg = RolloutConfig(n=4, temperature=0.9, top_k=0, response_length=16)
    s = SamplingSettings.resolve(cfg, {})
    assert (s.n, s.temperature, s.top_k, s.do_sample, s.response_length) == (4, 0.9, -1, True, 16)
    g = SamplingSettings.resolve(cfg, {"do_sample": False, "response_length": 4})
    assert (g.n, g.temperature, g.do_sample, g.response_length) == (1, 1.0, False, 4)
    assert SamplingSettings.resolve(cfg, {"n": 2, "temperature": 0.5}).meta()["temperature"] == 0.5
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings.resolve(cfg, {"temperature": 0.0})


def test_assemble_output_layout():
    """Right-padded responses, masks, positions continuing the prompt, non-tensors interleaved."""
    from ppoflow.infra.config import RolloutConfig
    from ppoflow.workers.rollout.base import SamplingSettings, assemble_output

    prompts = left_padded_prompts([3, 5], seed=2)
    s = SamplingSettings.resolve(RolloutConfig(n=2, response_length=4), {})
    out = assemble_output(
        prompts,
        [[7, 0], [8, 9, 10, 11], [12], [13, 14, 0]],
        [[-1.0, -2.0], [-1.0] * 4, [-3.0], [-1.0, -1.0, -0.5]],
        s,
        pad_token_id=1,
        metrics={"x": 1.0},
    )
    assert out.batch["responses"][0].tolist() == [7, 0, 1, 1]
    assert out.batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert out.batch["rollout_log_probs"][0].tolist() == [-1.0, -2.0, 0.0, 0.0]
    assert out.batch["position_ids"][0, P:].tolist() == [3, 4, 5, 6]
    assert out.batch["position_ids"][2, P:].tolist() == [5, 6, 7, 8]
    assert list(out.non_tensor_batch["uid"]) == ["p0", "p0", "p1", "p1"]
    assert out.meta_info["metrics"] == {"x": 1.0} and out.meta_info["n"] == 2
    with pytest.raises(ValueError, match="expected 2\\*2 responses"):
        assemble_output(prompts, [[1]], [[0.0]], s, pad_token_id=1, metrics={})


def test_prompts_without_their_columns_or_tokens_are_refused():
    from ppoflow.infra.data.dataproto import DataProto

    with pytest.raises(KeyError, match=r"needs prompt columns \['attention_mask'\]"):
        check_prompts(DataProto.from_dict({"input_ids": torch.ones(2, 3, dtype=torch.long)}))
    with pytest.raises(ValueError, match=r"input_ids \(2, 3\) and attention_mask \(2, 4\)"):
        check_prompts(
            DataProto.from_dict({"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 4)})
        )
    ids = torch.tensor([[1, 5, 6], [7, 8, 9]])
    assert prompt_token_lists(ids, torch.tensor([[0, 1, 1], [1, 1, 1]])) == [[5, 6], [7, 8, 9]]
    with pytest.raises(ValueError, match="a prompt row has no tokens"):
        prompt_token_lists(ids, torch.tensor([[0, 0, 0], [1, 1, 1]]))


def test_stop_tokens_are_the_tokenizer_s_and_the_generation_config_s(tmp_path):
    from transformers import GenerationConfig

    from ppoflow.demo.tiny_models import build_char_tokenizer

    tok = build_char_tokenizer()
    eos = int(tok.eos_token_id)
    assert eos_token_ids(tok, str(tmp_path)) == [eos]  # no generation config there
    GenerationConfig(eos_token_id=[eos, eos + 1, 2]).save_pretrained(tmp_path)
    assert eos_token_ids(tok, str(tmp_path)) == [eos, eos + 1, 2]


def test_request_seeds_repeat_for_the_same_parts_and_differ_otherwise():
    seeds = {request_seed(7, dp, call, row) for dp in range(2) for call in range(3) for row in range(4)}
    assert len(seeds) == 24 and all(0 <= s < 2**31 - 1024 for s in seeds)
    assert request_seed(7, 1, 2, 3) == request_seed(7, 1, 2, 3)
