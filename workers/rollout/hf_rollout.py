"""HFRollout: transformers ``generate`` on the actor's own FSDP module (``rollout.engine: hf``).

For machines without vLLM. There is no second copy of the weights and nothing to synchronise:
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

import time

import torch
from torch import nn

from ppoflow.infra.config import RolloutConfig
from ppoflow.infra.host_cpu import cpu_use
from ppoflow.workers.rollout.base import Rollout, SamplingSettings, assemble_output

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

    engine_name = "hf"

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
        if config.tensor_model_parallel_size != 1:
            raise ValueError(
                "rollout.engine=hf has no tensor parallelism: set rollout.tensor_model_parallel_size=1"
            )
        self.config = config
        self.module = actor_module
        self.hf_model = getattr(actor_module, "hf_model", actor_module)
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
        from torch.distributed.fsdp import FSDPModule

        s = SamplingSettings.resolve(self.config, prompts.meta_info)
        if "input_ids" not in prompts.batch or "attention_mask" not in prompts.batch:
            raise KeyError(
                f"generate_sequences needs input_ids and attention_mask; got {sorted(prompts.batch)}"
            )
        ids = prompts.batch["input_ids"].long().repeat_interleave(s.n, dim=0).to(self.device)
        mask = prompts.batch["attention_mask"].long().repeat_interleave(s.n, dim=0).to(self.device)
        kwargs = dict(
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
        was_training = self.module.training
        self.module.eval()
        t0 = time.perf_counter()
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # the iteration's seed (meta_info["seed"]) when the caller gives one, so a retried or
            # resumed rollout samples what the first attempt did; else a per-call stream
            base = prompts.meta_info.get("seed")
            base = self.config.seed * 1_000_003 + self.calls if base is None else int(base)
            torch.manual_seed((base * 7_919 + self.rank) % (2**63 - 1))
            with cpu_use() as cpu:
                out = self._generate(input_ids=ids, attention_mask=mask, **kwargs)
        generate_s = time.perf_counter() - t0
        self.calls += 1
        if isinstance(self.module, FSDPModule):
            for sub in self.module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()
        self.module.train(was_training)
        gen_dev = out.sequences[:, ids.shape[1] :]
        # one (B, V) step at a time on the device: stacking the scores would be a (B, R, V) fp32
        # tensor (40 GB for 256 x 256 tokens over a 152k vocabulary) copied to the host
        steps = [
            torch.log_softmax(sc.float(), dim=-1).gather(-1, gen_dev[:, t : t + 1]).squeeze(-1)
            for t, sc in enumerate(out.scores or ())
        ]
        token_lp = (torch.stack(steps, dim=1) if steps else torch.zeros(len(ids), 0)).cpu()
        gen = gen_dev.cpu()
        del out
        responses, log_probs = [], []
        eos = set([self.eos_token_id] if isinstance(self.eos_token_id, int) else (self.eos_token_id or []))
        for row, lp in zip(gen.tolist(), token_lp.tolist()):
            k = len(row)
            for j, tok in enumerate(row):
                if tok in eos:
                    k = j + 1
                    break
            responses.append(row[:k])
            log_probs.append(lp[:k])
        generated = sum(len(r) for r in responses)
        metrics = {
            "rollout/generate_s": generate_s,
            "rollout/tokens_per_s": generated / generate_s if generate_s > 0 else 0.0,
            **cpu.metrics("perf/rollout_"),
        }
        return assemble_output(prompts, responses, log_probs, s, self.pad_token_id, metrics)
