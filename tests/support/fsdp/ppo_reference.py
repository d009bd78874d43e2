"""Shared by the FSDP worker tests (tests/workers/test_actor_rollout_ref_worker.py,
test_critic_worker.py, test_hsdp.py): the tiny PPO config, a rollout-shaped batch, and the plain
single-process references (no FSDP, no process group) that the FSDP workers are checked against.

The references are written out plainly on purpose: a full (B, T, V) log-softmax, the whole
mini-batch in one backward, ``torch.optim.AdamW`` and ``clip_grad_norm_``.
"""

from __future__ import annotations

import torch

from ppoflow.algos import agg_loss, compute_policy_loss, compute_value_loss, kl_penalty
from ppoflow.infra.config import ExperimentConfig
from ppoflow.infra.data.dataproto import DataProto
from ppoflow.infra.remote.driver.group import WorkerGroup

ACTOR = "ppoflow.workers.actor_rollout_ref_worker:ActorRolloutRefWorker"
CRITIC = "ppoflow.workers.critic_worker:CriticWorker"
P, R, TEMPERATURE = 8, 6, 0.8
LOGPROB_TOL = 1e-5  # FSDP log-probs vs a plain forward (fp32); measured ~5e-7
WEIGHT_TOL = 5e-6  # weights after 2 AdamW steps, lr 1e-3, eps 1e-6 (fp32)


def make_config(
    model_dir: str,
    nprocs: int = 2,
    fsdp_size: int = -1,
    mini_batch: int = 4,
    epochs: int = 1,
    micro_batch: int = 3,
) -> ExperimentConfig:
    """Tiny PPO config: 8 prompts x n=2 per iteration, ``mini_batch`` prompts per optimizer step,
    padded micro-batches of ``micro_batch`` rows (the tests of packing turn it on themselves)."""
    # eps 1e-6, not 1e-8: at a gradient g ~ 0 Adam's step lr*g/(|g|+eps) has slope lr/eps, which
    # turns fp32 summation-order noise in g (~1e-10) into 1e-5 weight differences for a few elements.
    optim = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01, "grad_clip": 1.0}
    fsdp = {"fsdp_size": fsdp_size}
    return ExperimentConfig.model_validate(
        {
            "model": {"path": model_dir},
            "data": {"train_files": ["unused.parquet"], "train_batch_size": 8},
            "rollout": {
                "n": 2,
                "temperature": TEMPERATURE,
                "engine": "hf",
                "prompt_length": P,
                "response_length": R,
            },
            "actor": {
                "ppo_mini_batch_size": mini_batch,
                "ppo_micro_batch_size_per_gpu": micro_batch,
                "use_dynamic_bsz": False,
                "ppo_epochs": epochs,
                "log_prob_micro_batch_size_per_gpu": 3,
                "entropy_coeff": 0.01,
                "use_kl_loss": True,
                "kl_loss_coef": 0.1,
                "kl_loss_type": "low_var_kl",
                "optim": optim,
                "fsdp": fsdp,
            },
            "ref": {"fsdp": fsdp},
            "critic": {
                "ppo_mini_batch_size": mini_batch,
                "ppo_micro_batch_size_per_gpu": micro_batch,
                "ppo_epochs": epochs,
                "forward_micro_batch_size_per_gpu": 3,
                "cliprange_value": 0.2,
                "optim": optim,
                "fsdp": fsdp,
            },
            "resources": {"nprocs": nprocs},
            "seed": 7,
        }
    )


def plain_log_probs(hf, batch: dict, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) of the responses and the entropy, from a full (B, T, V) forward."""
    with torch.set_grad_enabled(grad):
        logits = (
            hf(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[:, P - 1 : -1]
            / TEMPERATURE
        )
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make_batch(model_dir: str, rows: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout-shaped batch: left-padded prompts (3..P tokens), right-padded responses (1..R),
    old/ref log-probs near the model's own, random advantages, values and returns."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    prompts = torch.full((rows, P), 1, dtype=torch.long)
    responses = torch.full((rows, R), 1, dtype=torch.long)
    attn = torch.zeros(rows, P + R, dtype=torch.long)
    for i in range(rows):
        p_len = int(torch.randint(3, P + 1, (1,), generator=g))
        r_len = int(torch.randint(1, R + 1, (1,), generator=g))
        prompts[i, P - p_len :] = torch.randint(5, 260, (p_len,), generator=g)
        responses[i, :r_len] = torch.randint(5, 260, (r_len,), generator=g)
        attn[i, P - p_len : P + r_len] = 1
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "response_mask": attn[:, P:].clone(),
    }
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    logp, _ = plain_log_probs(hf, batch)
    mask = batch["response_mask"].float()
    noise = lambda scale: scale * torch.randn(rows, R, generator=g)  # noqa: E731
    batch["old_log_probs"] = (logp + noise(0.3)) * mask
    batch["ref_log_prob"] = (logp + noise(0.3)) * mask
    batch["advantages"] = noise(1.0) * mask
    batch["values"] = noise(1.0) * mask
    batch["returns"] = noise(1.0) * mask
    return batch


def save_batch(batch: dict, url: str) -> str:
    DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}).save(url)
    return url


def mini_batch_groups(rows: int, nprocs: int, per_rank: int, epochs: int) -> list[list[int]]:
    """Global row indices of each optimizer step: the driver gives rank r rows
    [r*rows/nprocs, (r+1)*rows/nprocs); step k takes each rank's k-th slice of ``per_rank`` rows."""
    share = rows // nprocs
    steps = [
        [r * share + i for r in range(nprocs) for i in range(k, k + per_rank)]
        for k in range(0, share, per_rank)
    ]
    return steps * epochs


def _adamw(params, cfg) -> torch.optim.AdamW:
    o = cfg.optim
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


def reference_actor_update(
    model_dir: str, batch: dict, cfg: ExperimentConfig, groups: list[list[int]]
) -> dict:
    """Plain single-process PPO actor update: one AdamW step per group of rows, whole group at once."""
    from transformers import AutoModelForCausalLM

    a = cfg.actor
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train()
    opt = _adamw(hf.parameters(), a)
    for rows in groups:
        mb = {k: v[rows] for k, v in batch.items()}
        mask = mb["response_mask"]
        logp, entropy = plain_log_probs(hf, mb, grad=True)
        pg_loss, _, _, _ = compute_policy_loss(
            mb["old_log_probs"],
            logp,
            mb["advantages"],
            mask,
            a.clip_ratio_low,
            a.clip_ratio_high,
            a.clip_ratio_c,
            a.loss_agg_mode,
        )
        kl = agg_loss(kl_penalty(logp, mb["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode)
        loss = pg_loss - a.entropy_coeff * agg_loss(entropy, mask, a.loss_agg_mode) + a.kl_loss_coef * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), a.optim.grad_clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def plain_critic(model_dir: str, seed: int):
    """The critic as a plain HF token classifier, initialised like the workers (same seed)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels, config.classifier_dropout = 1, 0.0
    torch.manual_seed(seed)
    return AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)


def plain_values(critic, batch: dict, grad: bool = False) -> torch.Tensor:
    """(B, R) values: the score at the position before each response token."""
    with torch.set_grad_enabled(grad):
        out = critic(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    return out[:, P - 1 : -1, 0].float()


def reference_critic_update(
    model_dir: str, batch: dict, cfg: ExperimentConfig, groups: list[list[int]]
) -> dict:
    """Plain single-process clipped value-loss update, one AdamW step per group of rows."""
    c = cfg.critic
    critic = plain_critic(model_dir, cfg.seed)
    critic.train()
    opt = _adamw(critic.parameters(), c)
    for rows in groups:
        mb = {k: v[rows] for k, v in batch.items()}
        vf_loss, _ = compute_value_loss(
            plain_values(critic, mb, grad=True),
            mb["returns"],
            mb["values"],
            mb["response_mask"],
            c.cliprange_value,
            c.loss_agg_mode,
        )
        vf_loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), c.optim.grad_clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in critic.state_dict().items()}


def max_weight_diff(got: dict, want: dict) -> float:
    """Largest absolute difference over the reference's tensors (all must be present)."""
    missing = sorted(set(want) - set(got))
    assert not missing, f"checkpoint lacks {missing}"
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def start_group(worker: str, cfg: ExperimentConfig, nprocs: int, role: str | None = None) -> WorkerGroup:
    config = {"config": cfg.model_dump(mode="json")}
    if role:
        config["role"] = role
    return WorkerGroup(
        worker,
        nprocs=nprocs,
        config=config,
        device="cpu",
        log=lambda line: None,
        env={"PPOFLOW_RANK_THREADS": "1"},
    ).start()


def plain_actor(model_dir: str, cfg: ExperimentConfig, chunk_size: int = 1024):
    """DataParallelPPOActor on an unsharded PolicyLM (no process group: dp 1)."""
    from ppoflow.infra.config import ModelConfig
    from ppoflow.workers.actor import DataParallelPPOActor
    from ppoflow.workers.hf_models import load_hf_model
    from ppoflow.workers.modeling import PolicyLM
    from ppoflow.workers.optim import build_optimizer

    module = PolicyLM(load_hf_model(ModelConfig(path=model_dir), "causal_lm"), chunk_size=chunk_size)
    optimizer, scheduler = build_optimizer(module, cfg.actor.optim)
    rejected = cfg.algorithm.rollout_correction.mis_normaliser
    return DataParallelPPOActor(
        cfg.actor, module, optimizer, scheduler, rollout_n=cfg.rollout.n, rejected=rejected
    )
