"""Packed (padding-free) forwards and token-budget micro-batches (ppoflow.workers.packing), in one
process on CPU, float32, against the padded path and the plain references of ppo_reference.

Tolerances (fp32): log-probs, entropy and values of a packed forward equal the padded forward's
within 1e-5 (measured ~1e-6: the same sums in another order); weights after updates within the
5e-7 of the existing gradient-accumulation test (SGD, lr 1) and WEIGHT_TOL (AdamW, vs the plain loop).
"""

from __future__ import annotations

import pytest
import torch

from ppoflow.infra.data.dataproto import DataProto
from ppoflow.workers.packing import (
    VARLEN_ATTENTION,
    first_fit_decreasing,
    pack,
    split_to_count,
    token_budget_micro_batches,
)
from tests.support.fsdp.ppo_reference import (
    TEMPERATURE,
    WEIGHT_TOL,
    P,
    R,
    make_config,
    max_weight_diff,
    mini_batch_groups,
    plain_actor,
    plain_critic,
    plain_log_probs,
    plain_values,
    reference_actor_update,
)

pytestmark = pytest.mark.usefixtures("one_thread")
PACK_TOL = 1e-5


def uneven_batch(batch: dict) -> dict:
    """The tiny batch with its first rows made extreme: a 1-token prompt with a 1-token response,
    the full P + R tokens, and a row with an empty response (nothing to score, still packed)."""
    b = {k: v.clone() for k, v in batch.items()}
    attn = b["attention_mask"]
    attn[0] = 0
    attn[0, P - 1 : P + 1] = 1  # 1 prompt token + 1 response token
    attn[1] = 1  # the maximum: every position real
    attn[2, P:] = 0  # no response tokens
    b["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    b["response_mask"] = attn[:, P:].clone()
    for key in ("old_log_probs", "ref_log_prob", "advantages", "values", "returns"):
        b[key] = b[key] * b["response_mask"]
    return b


def test_pack_layout():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 1, 2, 0, 0]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    p = pack(ids, attn, pos)
    assert p.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert p.cu_seqlens.tolist() == [0, 3, 7] and p.cu_seqlens.dtype == torch.int32 and p.max_len == 4
    assert p.index.tolist() == [[-1, -1, 0, 1, 2, -1], [3, 4, 5, 6, -1, -1]]


def test_token_budget_groups():
    lengths = [14, 2, 7, 9, 1, 14, 3, 5]
    groups = first_fit_decreasing(lengths, 16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 16 for g in groups)
    assert len(groups) == 4  # 55 tokens need at least 4 groups of 16
    for count in range(4, 9):
        split = split_to_count(groups, lengths, count)
        assert len(split) == count and all(split)
        assert sorted(i for g in split for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= 16 for g in split)
    with pytest.raises(ValueError, match="cannot form 9"):
        split_to_count(groups, lengths, 9)
    with pytest.raises(
        ValueError, match="actor.ppo_max_token_len_per_gpu=10 is smaller than a sequence of 14"
    ):
        token_budget_micro_batches(torch.tensor(lengths), 10, "cpu", "actor.ppo_max_token_len_per_gpu")


def test_config_token_budget_must_hold_the_longest_row():
    from ppoflow.infra.config import ConfigError, parse_config

    base = {"model": {"path": "m"}, "data": {"train_files": ["x.parquet"]}}
    base["rollout"] = {"prompt_length": 64, "response_length": 32}
    ok = parse_config({**base, "actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 96}})
    assert ok.actor.use_dynamic_bsz and ok.actor.log_prob_max_token_len_per_gpu is None
    with pytest.raises(ConfigError, match=r"critic.ppo_max_token_len_per_gpu=95 .* at least 96"):
        parse_config({**base, "critic": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 95}})
    with pytest.raises(ConfigError, match=r"ref.log_prob_max_token_len_per_gpu=50"):
        parse_config(
            {**base, "ref": {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 50}}
        )


def _policy(model_dir: str, packed: bool, chunk_size: int = 5):
    from ppoflow.infra.config import ModelConfig
    from ppoflow.workers.hf_models import load_hf_model
    from ppoflow.workers.modeling import PolicyLM
    from ppoflow.workers.packing import use_varlen_attention

    hf = load_hf_model(ModelConfig(path=model_dir), "causal_lm")
    if packed:
        use_varlen_attention(hf)
    return PolicyLM(hf, chunk_size=chunk_size)


def test_packed_log_probs_equal_padded_and_plain(tiny):
    """Packed log-probs and entropy == the padded forward == a plain HF forward, on a batch with a
    1-token row, a full-length row and an empty response; the padded path of a varlen model is sdpa."""
    batch = uneven_batch(tiny["batch"])
    mask = batch["response_mask"].bool()
    hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32)
    want_lp, want_ent = plain_log_probs(hf.eval(), batch)
    inputs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    }
    padded_model, packed_model = _policy(tiny["dir"], False), _policy(tiny["dir"], True)
    assert packed_model.config._attn_implementation == VARLEN_ATTENTION
    with torch.no_grad():
        padded = padded_model(**inputs, temperature=TEMPERATURE, with_entropy=True)
        packed = packed_model(**inputs, temperature=TEMPERATURE, with_entropy=True, packed=True)
        varlen_padded = packed_model(**inputs, temperature=TEMPERATURE, with_entropy=True)
    for out in (padded, packed, varlen_padded):
        assert (out["log_probs"][~mask] == 0).all()
        assert (out["log_probs"] - want_lp)[mask].abs().max() < PACK_TOL
        assert (out["entropy"] - want_ent)[mask].abs().max() < PACK_TOL
    assert (packed["log_probs"] - padded["log_probs"]).abs().max() < PACK_TOL


def test_packed_llama_equals_padded(tmp_path):
    """The same on a tiny Llama (another model family through the AttentionInterface)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    from tests.support.fsdp.ppo_reference import make_batch

    batch = uneven_batch(make_batch(str(tmp_path), rows=6, seed=3))
    inputs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    }
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        padded = _policy(str(tmp_path), False)(**inputs, temperature=TEMPERATURE)
        packed = _policy(str(tmp_path), True)(**inputs, temperature=TEMPERATURE, packed=True)
    assert (packed["log_probs"] - padded["log_probs"])[mask].abs().max() < PACK_TOL


def test_packed_values_equal_plain(tiny):
    from ppoflow.infra.config import ModelConfig
    from ppoflow.workers.hf_models import load_hf_model
    from ppoflow.workers.modeling import ValueModel
    from ppoflow.workers.packing import use_varlen_attention

    batch = uneven_batch(tiny["batch"])
    mask = batch["response_mask"].bool()
    torch.manual_seed(7)
    hf = load_hf_model(ModelConfig(path=tiny["dir"]), "token_classification")
    use_varlen_attention(hf)
    critic = ValueModel(hf)
    with torch.no_grad():
        got = critic(
            batch["input_ids"],
            batch["attention_mask"],
            batch["position_ids"],
            R,
            batch["response_mask"],
            packed=True,
        )
        want = plain_values(plain_critic(tiny["dir"], 7).eval(), batch)
    assert (got[~mask] == 0).all()
    assert (got - want)[mask].abs().max() < PACK_TOL


def _sgd_update(tiny, batch, mode: str, micro: int, budget: int | None) -> dict:
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.loss_agg_mode = mode
    cfg.actor.ppo_micro_batch_size_per_gpu = micro
    if budget is not None:
        cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu = True, budget
    actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
    if budget is not None:
        from ppoflow.workers.packing import use_varlen_attention

        use_varlen_attention(actor.module.hf_model)
    actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
    metrics = actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert metrics["actor/optimizer_steps"] == 1
    return {k: v.detach().clone() for k, v in actor.module.state_dict().items()}


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_token_budget_update_equals_padded_for_every_loss_agg_mode(tiny, mode):
    """One step on the whole mini-batch padded == packed micro-batches of any token budget: the
    longest row alone (many micro-batches of unequal rows), and everything in one. SGD lr 1 makes
    the weight change the (clipped) gradient itself."""
    batch = uneven_batch(tiny["batch"])
    want = _sgd_update(tiny, batch, mode, micro=16, budget=None)
    for budget in (P + R, 1000):
        assert max_weight_diff(_sgd_update(tiny, batch, mode, micro=16, budget=budget), want) < 5e-7


def test_token_budget_adamw_update_equals_the_plain_loop(tiny):
    """Two AdamW steps with packed token-budget micro-batches == the plain single-process loop
    (full logits, whole mini-batch in one backward) of ppo_reference."""
    batch = uneven_batch(tiny["batch"])
    cfg = make_config(tiny["dir"], nprocs=1, mini_batch=4)
    cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu = True, 20
    actor = plain_actor(tiny["dir"], cfg)
    from ppoflow.workers.packing import use_varlen_attention

    use_varlen_attention(actor.module.hf_model)
    actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    want = reference_actor_update(tiny["dir"], batch, cfg, mini_batch_groups(16, 1, 8, 1))
    assert max_weight_diff(actor.module.state_dict(), want) < WEIGHT_TOL


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_micro_batch_without_response_tokens_still_backpropagates(impl):
    """A (packed) micro-batch can hold only rows without response tokens: its log-probs are empty
    but must stay on the graph, or that rank skips backward and FSDP's collectives fall out of step."""
    from ppoflow.workers.modeling import chunked_log_probs

    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(3, 8, requires_grad=True)
    lp, ent = chunked_log_probs(hidden[:0], head, torch.zeros(0, dtype=torch.long), 0.7, True, True, 5, impl)
    assert lp.shape == (0,) and ent.shape == (0,) and lp.grad_fn is not None
    (lp.sum() - ent.sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None and not head.weight.grad.any()


@pytest.mark.slow
def test_compiled_layers_and_head_equal_eager(tiny):
    """``model.use_torch_compile``: decoder layers through torch.compile (the packed attention runs
    eagerly between their graphs) and the fused head's compiled math give the eager log-probs,
    entropy and gradients (fp32, inductor on CPU here), packed and padded."""
    from ppoflow.workers.compiled import compile_decoder_layers

    batch = uneven_batch(tiny["batch"])
    mask = batch["response_mask"].bool()
    inputs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    }

    def run(model, packed):
        model.train()
        model.zero_grad(set_to_none=True)
        out = model(**inputs, temperature=TEMPERATURE, with_entropy=True, entropy_grad=True, packed=packed)
        (out["log_probs"][mask].sum() + 0.1 * out["entropy"][mask].sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return out["log_probs"].detach(), out["entropy"].detach(), grads

    eager = _policy(tiny["dir"], True)
    eager.head_impl = "fused"
    compiled = _policy(tiny["dir"], True)
    compiled.head_impl, compiled.compiled_head = "fused", True
    compile_decoder_layers(compiled.hf_model)
    for packed in (True, False):
        (lp0, ent0, g0), (lp1, ent1, g1) = run(eager, packed), run(compiled, packed)
        assert (lp1 - lp0)[mask].abs().max() < PACK_TOL and (ent1 - ent0)[mask].abs().max() < PACK_TOL
        assert (g1 - g0).norm() / g0.norm() < 1e-5
    # generation with a KV cache (rollout.engine: hf) goes through the eager forward: same tokens
    prompt = {"input_ids": batch["input_ids"][:2, :P], "attention_mask": batch["attention_mask"][:2, :P]}
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=1)
    with torch.no_grad():
        want = eager.eval().hf_model.generate(**prompt, **kwargs)
        got = compiled.eval().hf_model.generate(**prompt, **kwargs)
    assert torch.equal(got, want)
