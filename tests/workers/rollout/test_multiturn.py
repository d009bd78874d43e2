"""Multi-turn rollouts on 2 CPU ranks (vLLM engines, and the HF engine on the FSDP actor) with a
scripted environment, checked against independent references:

- every policy turn is exactly what vLLM samples alone for that context and seed (token-in /
  token-out: nothing re-tokenized), and the engine's log-probs of the policy tokens equal the
  FSDP actor's recomputation over the whole episode;
- every environment span is the template's text for the environment's message, tokenized alone;
- the loss mask is 1 on the policy's tokens only; each turn's reward sits on its last token;
- the same seed gives the same episodes (a retried generate), another seed other ones;
- masked positions do not reach the PPO loss's gradient (a real model's log-probs, against a
  plain sum over the policy's tokens), and GAE over an episode equals GAE over its policy tokens
  alone.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = "tests.support.rollout.rollout_test_worker:RolloutTestWorker"
P, R, TURN = 24, 40, 5
LOGPROB_TOL = 1e-4
SEED = 0


def _prompts():
    """4 rows (2 per rank): episodes of 1, 2, 3 and 3 turns (``ScriptedEnv``)."""
    from ppoflow.infra.data.dataproto import DataProto

    turns = [1, 2, 3, 3]
    ids = torch.full((4, P), 1, dtype=torch.long)
    mask = torch.zeros((4, P), dtype=torch.long)
    ids[:, -2:], mask[:, -2:] = 60, 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask},
        {
            "uid": [f"p{i}" for i in range(4)],
            "extra_info": np.array([{"index": i, "turns": t} for i, t in enumerate(turns)], dtype=object),
        },
    )


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    from transformers import AutoTokenizer

    from ppoflow.demo.tiny_models import save_tiny_model
    from ppoflow.infra.data.dataproto import DataProto
    from ppoflow.infra.remote.driver.group import WorkerGroup

    model = save_tiny_model(str(tmp_path_factory.mktemp("mt") / "tiny"), seed=0)
    work = str(tmp_path_factory.mktemp("mt-work"))
    config = {
        "model_path": model,
        "prompt_length": P,
        "response_length": R,
        "kv_cache_gib": 0.0625,
        "seed": SEED,
        "also_hf": True,
        "multi_turn": {
            "enable": True,
            "environment": "tests.support.multiturn_envs:ScriptedEnv",
            "max_turns": 3,
            "max_turn_tokens": TURN,
            "tools": [],
        },
    }
    prompts = _prompts()
    data = os.path.join(work, "prompts.arrow")
    prompts.save(data)

    def call(g, name, **meta):
        return DataProto.load(g.call("generate", data, out_url=os.path.join(work, f"{name}.arrow"), **meta))

    rec: dict = {"tok": AutoTokenizer.from_pretrained(model)}
    lines: list[str] = []
    t0 = time.perf_counter()
    with WorkerGroup(WORKER, nprocs=2, config=config, log=lines.append) as g:
        g.call("init_model")
        rec["a"] = call(g, "a", seed=5, n=2, temperature=0.8)
        rec["b"] = call(g, "b", seed=5, n=2, temperature=0.8)
        rec["other"] = call(g, "other", seed=6, n=2, temperature=0.8)
        rec["hf"] = call(g, "hf", engine="hf", seed=5, n=1, temperature=1.0)
        rec["replayed"] = g.call("replay", _replay_requests(rec["a"], n=2, temperature=0.8))[0]
    rec["wall_s"] = time.perf_counter() - t0
    print(f"multi-turn scenario: {rec['wall_s']:.1f} s")
    return rec


def _segments(row_turns: torch.Tensor, row_mask: torch.Tensor) -> list[tuple[int, int, int, bool]]:
    """(turn, start, end, policy) spans of one row, from its turn_ids and loss mask."""
    spans: list[tuple[int, int, int, bool]] = []
    for pos, (t, m) in enumerate(zip(row_turns.tolist(), row_mask.tolist())):
        if t < 0:
            break
        if spans and spans[-1][0] == t and spans[-1][3] == bool(m):
            spans[-1] = (t, spans[-1][1], pos + 1, bool(m))
        else:
            spans.append((t, pos, pos + 1, bool(m)))
    return spans


def _replay_requests(out, n: int, temperature: float) -> list[dict]:
    """Each policy turn of ``out`` as a lone request: its context and the seed the rollout gave it
    (``request_seed(seed, dp_rank, "seed", meta seed, "episode", e, "turn", t)``; 2 rows per rank)."""
    from ppoflow.workers.rollout.vllm_rollout import request_seed

    requests = []
    per_rank = 2 * n
    for b in range(len(out)):
        rank, episode = divmod(b, per_rank)
        prompt = out.batch["prompts"][b][out.batch["attention_mask"][b, :P].bool()].tolist()
        resp = out.batch["responses"][b].tolist()
        for t, lo, _hi, policy in _segments(out.batch["turn_ids"][b], out.batch["response_mask"][b]):
            if policy:
                seed = request_seed(SEED, rank, "seed", 5, "episode", episode, "turn", t)
                requests.append(
                    {
                        "context": prompt + resp[:lo],
                        "seed": seed,
                        "max_tokens": TURN,
                        "temperature": temperature,
                    }
                )
    return requests


def _check_structure(out, tok, n: int) -> None:
    want_turns = np.repeat([1, 2, 3, 3], n)
    assert out.batch["num_turns"].tolist() == want_turns.tolist()
    for b in range(len(out)):
        resp, mask = out.batch["responses"][b], out.batch["response_mask"][b]
        spans = _segments(out.batch["turn_ids"][b], mask)
        policy = [s for s in spans if s[3]]
        env = [s for s in spans if not s[3]]
        assert [s[0] for s in policy] == list(range(want_turns[b]))
        assert [s[0] for s in env] == list(range(want_turns[b] - 1))
        for t, lo, hi, _ in env:  # the template's delimiters around "obs<t>", tokenized alone
            assert resp[lo:hi].tolist() == tok.encode(
                f"<|user|>obs{t}<|assistant|>", add_special_tokens=False
            )
        for _t, lo, hi, _ in policy:
            assert 1 <= hi - lo <= TURN
        # the loss mask: exactly the policy spans; attention: every episode token
        covered = torch.zeros_like(mask)
        for _, lo, hi, _ in policy:
            covered[lo:hi] = 1
        assert torch.equal(mask, covered)
        end = spans[-1][2]
        assert out.batch["attention_mask"][b, P:].tolist() == [1] * end + [0] * (R - end)
        # rewards: 0.5 (t + 1) on the last token of turn t, 10 on the episode's last policy token
        want = torch.zeros(R)
        for t, _lo, hi, _ in policy:
            want[hi - 1] = 10.0 if t == want_turns[b] - 1 else 0.5 * (t + 1)
        assert torch.equal(out.batch["env_scores"][b], want)


def test_vllm_episodes_structure_and_rewards(episodes):
    _check_structure(episodes["a"], episodes["tok"], n=2)
    m = episodes["a"].meta_info["metrics"]
    # the whole batch's (both ranks'): episodes of 1, 1, 2, 2, 3, 3, 3, 3 turns
    turns = [1, 1, 2, 2, 3, 3, 3, 3]
    assert m["rollout/turns_mean"] == pytest.approx(sum(turns) / 8) and m["rollout/turns_max"] == 3
    assert m["rollout/ended_done_share"] == 1.0
    # a "fake" call after every turn but the last, failing after odd turns: 10 calls, 4 errors
    calls = sum(t - 1 for t in turns)
    errors = sum(1 for t in turns for k in range(t - 1) if k % 2 == 1)
    assert m["tool/fake/calls_per_episode"] == pytest.approx(calls / 8)
    assert m["tool/fake/error_rate"] == pytest.approx(errors / calls)
    assert m["rollout/tokens_per_s"] > 0


def test_policy_turns_are_the_engine_s_own_samples(episodes):
    out = episodes["a"]
    sampled = [
        out.batch["responses"][b][lo:hi].tolist()
        for b in range(len(out))
        for _, lo, hi, policy in _segments(out.batch["turn_ids"][b], out.batch["response_mask"][b])
        if policy
    ]
    assert sampled == episodes["replayed"]
    mask = out.batch["response_mask"].bool()
    diff = (out.batch["rollout_log_probs"] - out.batch["old_log_probs"])[mask].abs().max()
    assert float(diff) < LOGPROB_TOL  # the actor, over the whole episode, agrees token by token


def test_same_seed_same_episodes(episodes):
    a, b, other = episodes["a"], episodes["b"], episodes["other"]
    for key in ("responses", "response_mask", "turn_ids", "env_scores"):
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert not torch.equal(a.batch["responses"], other.batch["responses"])


def test_hf_engine_episodes(episodes):
    out = episodes["hf"]
    _check_structure(out, episodes["tok"], n=1)
    mask = out.batch["response_mask"].bool()
    diff = (out.batch["rollout_log_probs"] - out.batch["old_log_probs"])[mask].abs().max()
    assert float(diff) < 1e-3


def test_masked_tokens_do_not_reach_the_loss(episodes, one_thread):
    """The PPO loss of an episode batch (a real model's log-probs over prompt + episode): its
    gradient equals that of a plain sum over the policy's tokens, and env-token log-probs do not
    change it."""
    from transformers import AutoModelForCausalLM

    from ppoflow.algos.losses import compute_policy_loss
    from ppoflow.demo.tiny_models import save_tiny_model

    out = episodes["a"]
    d = os.path.join(os.path.dirname(episodes["tok"].name_or_path), "grad-model")
    model = AutoModelForCausalLM.from_pretrained(save_tiny_model(d, seed=3)).float()
    ids, attn, resp_mask = out.batch["input_ids"], out.batch["attention_mask"], out.batch["response_mask"]
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(resp_mask.shape, generator=g)

    def log_probs():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    lp = log_probs()
    loss, *_ = compute_policy_loss(lp.detach(), lp, adv, resp_mask, loss_agg_mode="token-mean")
    ours = grads(loss)
    lp = log_probs()
    plain = sum(-adv[b, t] * torch.exp(lp[b, t] - lp[b, t].detach()) for b, t in resp_mask.nonzero().tolist())
    ref = grads(plain / int(resp_mask.sum()))
    assert all(torch.allclose(a, r, atol=1e-6, rtol=1e-4) for a, r in zip(ours, ref))
    lp = log_probs().detach()
    noisy = torch.where(resp_mask.bool(), lp, lp + 5.0)  # other log-probs on environment tokens
    a, *_ = compute_policy_loss(lp, lp + 0.01, adv, resp_mask)
    b, *_ = compute_policy_loss(noisy, lp + 0.01, adv, resp_mask)
    assert torch.equal(a, b)


def test_gae_over_an_episode_is_gae_over_its_policy_tokens(episodes):
    from ppoflow.algos import compute_advantage

    out = episodes["a"]
    mask = out.batch["response_mask"]
    g = torch.Generator().manual_seed(1)
    values = torch.randn(mask.shape, generator=g)
    rewards = out.batch["env_scores"]
    gamma, lam = 0.9, 0.8
    _, returns = compute_advantage(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=gamma, lam=lam
    )
    for b in range(len(out)):
        idx = mask[b].nonzero().flatten().tolist()
        r, v = rewards[b, idx].tolist(), values[b, idx].tolist()
        adv, nxt_v, run = [0.0] * len(idx), 0.0, 0.0
        for i in reversed(range(len(idx))):  # GAE on the policy tokens alone, a plain loop
            run = r[i] + gamma * nxt_v - v[i] + gamma * lam * run
            adv[i], nxt_v = run, v[i]
        want = torch.tensor([a + val for a, val in zip(adv, v)])
        assert torch.allclose(returns[b, idx], want, atol=1e-5)
        assert torch.all(returns[b][mask[b] == 0] == 0)
