"""HFRollout: transformers ``generate`` on the actor's own FSDP module (``rollout.engine: hf``).

For hosts without vLLM. There is no second copy of the weights and nothing to synchronise:
generation runs on the live FSDP2 policy, so it always samples from the current weights (its
sharding manager is a no-op).

How it drives FSDP: the actor module is the FSDP root (``ppoflow.workers.modeling.PolicyLM``), whose
unregistered ``hf_model`` attribute is the Hugging Face model sharing the root's children. The
HF model's ``generate`` is attached to the root as a method and registered with
``torch.distributed.fsdp.register_fsdp_forward_method``, so the root's pre/post-forward hooks
(gather the root-owned embeddings, final norm and head) run around it, and each decoder layer's
own hooks gather and free it during every step. ``synced_gpus=True`` makes every rank run the
same number of forward steps even when its rows finish early: each step is a collective.

Sampling: each rank forks the torch RNG and seeds it with ``(seed, rank, call number)``, so ranks
sample different streams without disturbing the training RNG. Log-probs are the log-softmax of
``generate``'s scores, i.e. after temperature (and top-k/top-p), as with vLLM's processed
log-probs; greedy decoding reports temperature-1 log-probs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from ppoflow.infra.config import RolloutConfig
from ppoflow.infra.runtime.host_cpu import cpu_use
from ppoflow.workers.fsdp_utils import reshard_all
from ppoflow.workers.rollout.base import (
    EngineSite,
    Rollout,
    SamplingSettings,
    TurnSamples,
    assemble_output,
    check_prompts,
    eos_token_ids,
    generation_metrics,
    request_seed,
)

__all__ = ["HFRollout"]

_METHOD = "ppoflow_generate"


class HFRollout(Rollout):
    """transformers generation on the actor module (FSDP root or plain module).

    Args:
        config: the ``rollout`` section.
        actor_module: the policy; an object with ``hf_model`` (``PolicyLM``) or an HF causal LM.
        eos_token_id, pad_token_id: stop token(s) and right-padding value.
        rank, world_size: this rank; every rank is its own data-parallel replica (tp_size 1).
        device: where the prompts go (the module's compute device).
    """

    def __init__(
        self,
        config: RolloutConfig,
        actor_module: nn.Module,
        *,
        eos_token_id: int | list[int] | None,
        pad_token_id: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ):
        self.config = config  # its tensor_model_parallel_size is 1: the engine has no tensor_parallel
        self.module = actor_module
        self.hf_model: Any = getattr(actor_module, "hf_model", actor_module)  # an HF causal LM
        if not hasattr(self.hf_model, "generate"):
            raise TypeError(
                f"{type(self.hf_model).__name__} has no generate(): HFRollout needs a Hugging Face "
                "causal LM (or a wrapper with .hf_model)"
            )
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.rank, self.world_size = rank, world_size
        self.dp_rank, self.dp_size = rank, world_size
        self.device = torch.device(device)
        self.calls = 0
        self._generate = self._bind_generate()

    @classmethod
    def from_config(cls, config: Any, site: EngineSite, **engine_kwargs: Any) -> HFRollout:
        """``rollout.engine: hf`` on ``site``'s actor module (it takes no ``engine_kwargs``)."""
        if site.actor_module is None:
            raise ValueError("rollout.engine=hf generates with the actor module: pass actor_module")
        return cls(
            config.rollout,
            site.actor_module,
            eos_token_id=eos_token_ids(site.tokenizer, site.model_path),
            pad_token_id=site.pad_token_id,
            rank=site.rank,
            world_size=site.world_size,
            device=site.device,
        )

    def _bind_generate(self):
        """``hf_model.generate`` wrapped in the FSDP root's forward hooks (plain call without FSDP)."""
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if not isinstance(self.module, FSDPModule) or self.module is self.hf_model:
            return self.hf_model.generate
        if not hasattr(self.module, _METHOD):
            hf_model = self.hf_model

            def generate(*args, **kwargs):
                return hf_model.generate(*args, **kwargs)

            self.module.__dict__[_METHOD] = generate
            register_fsdp_forward_method(self.module, _METHOD)
        return getattr(self.module, _METHOD)

    @torch.no_grad()
    def generate_sequences(self, prompts):
        """Sample ``n`` responses per prompt row with ``generate``; columns as in ``ppoflow.workers.rollout.base``."""
        s = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_prompts(prompts)
        ids = prompts.batch["input_ids"].long().repeat_interleave(s.n, dim=0).to(self.device)
        mask = prompts.batch["attention_mask"].long().repeat_interleave(s.n, dim=0).to(self.device)
        out, generate_s, cpu = self._sample(
            ids, mask, self._generate_kwargs(s), prompts.meta_info.get("seed")
        )
        gen, token_lp = _sampled_tokens(out, ids.shape[1])
        del out
        responses, log_probs = _cut_at_eos(gen, token_lp, self.eos_token_id)
        metrics = generation_metrics(generate_s, sum(len(r) for r in responses), cpu)
        return assemble_output(prompts, responses, log_probs, s, self.pad_token_id, metrics)

    def sample_turn(
        self,
        contexts: list[list[int]],
        limits: list[int],
        episode_ids: list[int],
        turn: int,
        settings: SamplingSettings,
        meta_seed: Any,
        call: int,
    ) -> TurnSamples:
        """One turn of multi-turn episodes (see ``Rollout.sample_turn``): the contexts left-padded
        into one ``generate`` call of the longest limit, each row cut at its own limit; seeded from
        (``meta_seed`` or ``call``, ``turn``). A rank without contexts still generates one padding
        row: every ``generate`` is a collective over the ranks."""
        rows = contexts or [[self.pad_token_id]]
        width = max(len(c) for c in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, c in enumerate(rows):
            ids[r, width - len(c) :] = torch.as_tensor(c)
            mask[r, width - len(c) :] = 1
        most = max(limits) if limits else 1
        kwargs = self._generate_kwargs(dataclasses.replace(settings, response_length=most))
        seed = request_seed("hf", call if meta_seed is None else meta_seed, "turn", turn)
        out, _, _ = self._sample(ids.to(self.device), mask.to(self.device), kwargs, seed)
        gen, token_lp = _sampled_tokens(out, width)
        responses, log_probs = _cut_at_eos(gen, token_lp, self.eos_token_id)
        if not contexts:
            return []
        return [(r[:m], lp[:m]) for r, lp, m in zip(responses, log_probs, limits)]

    def _generate_kwargs(self, s: SamplingSettings) -> dict[str, Any]:
        """``generate``'s keyword arguments for one call's sampling settings (greedy: no sampling
        parameters, so the model's generation config cannot add any)."""
        kwargs: dict[str, Any] = dict(
            max_new_tokens=s.response_length,
            do_sample=s.do_sample,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            synced_gpus=self.world_size > 1,
            use_cache=True,
        )
        if s.do_sample:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else 0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    def _sample(
        self, ids: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any], meta_seed: Any
    ) -> tuple[Any, float, Any]:
        """``generate`` in eval mode on a forked, seeded RNG, then the FSDP module resharded and put
        back in its mode; returns (generate's output, its seconds, the CPU it got)."""
        from torch.distributed.fsdp import FSDPModule

        was_training = self.module.training
        self.module.eval()
        t0 = time.perf_counter()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self._seed(meta_seed))
            with cpu_use() as cpu:
                out = self._generate(input_ids=ids, attention_mask=mask, **kwargs)
        generate_s = time.perf_counter() - t0
        self.calls += 1
        if isinstance(self.module, FSDPModule):
            reshard_all(self.module)
        self.module.train(was_training)
        return out, generate_s, cpu

    def _seed(self, meta_seed: Any) -> int:
        """This rank's seed for one call: from the iteration's seed (``meta_info["seed"]``) when the
        caller gives one, so a retried or resumed rollout samples what the first attempt did; else
        from a per-call stream. Ranks sample different streams."""
        base = self.config.seed * 1_000_003 + self.calls if meta_seed is None else int(meta_seed)
        return (base * 7_919 + self.rank) % (2**63 - 1)


def _sampled_tokens(out: Any, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(generated tokens (B*n, R'), their log-probs (B*n, R')) on the CPU from ``generate``'s output:
    the log-softmax of each step's scores at the token it chose."""
    gen_dev = out.sequences[:, prompt_len:]
    # one (B, V) step at a time on the device: stacking the scores would be a (B, R, V) fp32
    # tensor (40 GB for 256 x 256 tokens over a 152k vocabulary) copied to the host
    steps = [
        torch.log_softmax(sc.float(), dim=-1).gather(-1, gen_dev[:, t : t + 1]).squeeze(-1)
        for t, sc in enumerate(out.scores or ())
    ]
    token_lp = (torch.stack(steps, dim=1) if steps else torch.zeros(len(gen_dev), 0)).cpu()
    return gen_dev.cpu(), token_lp


def _cut_at_eos(
    gen: torch.Tensor, token_lp: torch.Tensor, eos_token_id: int | list[int] | None
) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's tokens and log-probs up to and including its first stop token (all of them when
    it has none: it ran to the length limit)."""
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    responses, log_probs = [], []
    for row, lp in zip(gen.tolist(), token_lp.tolist()):
        k = len(row)
        for j, tok in enumerate(row):
            if tok in eos:
                k = j + 1
                break
        responses.append(row[:k])
        log_probs.append(lp[:k])
    return responses, log_probs
