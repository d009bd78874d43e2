"""FSDP workers on real gloo ranks (ppoflow.infra.remote.driver.group.WorkerGroup), tiny Qwen2, float32.

Checked against a single process without FSDP, written plainly here:
- ``compute_log_prob`` (2 ranks) == ``log_softmax(logits / T)`` of a plain HF forward, within 1e-5;
  ``compute_ref_log_prob`` too (after an update: the reference stays frozen); ``generate_sequences``
  (HF engine) recomputes ``old_log_probs`` equal to the engine's own ``rollout_log_probs``;
- one ``update_actor`` (2 mini-batches, micro-batch 3 < mini-batch 4 rows per rank: gradient
  accumulation over unequal micro-batches, entropy bonus, KL loss, grad clipping), with
  ``resources.deterministic`` on, gives the weights of a plain AdamW loop over the same
  mini-batches, within ``WEIGHT_TOL``;
- ``compute_values`` and one ``update_critic`` likewise for the critic.
One group per worker class; every check on a group runs in one test to pay the start once.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from ppoflow.infra.checkpoint.sharded import load_full_state_dict
from ppoflow.infra.data.dataproto import DataProto
from tests.support.fsdp.ppo_reference import (
    ACTOR,
    CRITIC,
    LOGPROB_TOL,
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
    reference_critic_update,
    save_batch,
    start_group,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_actor_log_prob_and_update_match_single_process(tiny):
    cfg = make_config(tiny["dir"])
    # the update runs under torch's strict deterministic mode (it raises on an op without a
    # deterministic kernel) and must still give the plain loop's weights
    cfg.resources.deterministic = True
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "rollout.arrow"))
    t0 = time.perf_counter()
    prompts_url = save_batch(
        {k: v[::4, :P] for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")},
        str(tmp / "prompts.arrow"),
    )
    with start_group(ACTOR, cfg, 2, role="actor_rollout_ref") as group:
        infos = group.call("init_model")
        t_init = time.perf_counter() - t0
        assert infos[0]["actor"]["mesh_shape"] == [2] and infos[0]["actor"]["mesh_dim_names"] == ["fsdp"]
        assert infos[0]["ref"]["mesh_shape"] == [2] and infos[0]["rollout"]["engine"] == "HFRollout"

        # generate (HF engine on the FSDP actor), then old log-probs recomputed by the actor (seed 2.1.3)
        gen = DataProto.load(group.call("generate_sequences", prompts_url))
        assert len(gen) == 4 * cfg.rollout.n and gen.batch["responses"].shape[1] == R
        gmask = gen.batch["response_mask"].bool()
        gen_err = (gen.batch["old_log_probs"] - gen.batch["rollout_log_probs"])[gmask].abs().max().item()
        assert gen_err < LOGPROB_TOL, gen_err

        out = DataProto.load(
            group.call("compute_log_prob", data_url, out_url=str(tmp / "lp.arrow"), calculate_entropy=True)
        )
        hf = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny["dir"], dtype=torch.float32)
        want_lp, want_ent = plain_log_probs(hf.eval(), batch)
        mask = batch["response_mask"].bool()
        lp_err = (out.batch["old_log_probs"] - want_lp)[mask].abs().max().item()
        ent_err = (out.batch["entropys"] - want_ent)[mask].abs().max().item()
        assert lp_err < LOGPROB_TOL and ent_err < LOGPROB_TOL, (lp_err, ent_err)
        assert (out.batch["old_log_probs"][~mask] == 0).all()

        metrics = group.call("update_actor", data_url)
        # the reference stays at the base weights after the actor's update
        ref = DataProto.load(group.call("compute_ref_log_prob", data_url)).batch["ref_log_prob"]
        ref_err = (ref - want_lp)[mask].abs().max().item()
        assert ref_err < LOGPROB_TOL, ref_err
        ckpt = str(tmp / "actor_ckpt")
        group.call("save_checkpoint", ckpt, extra={"iteration": 1})
    m = metrics[0]
    assert {k: v for k, v in m.items() if not k.startswith("perf/")} == {
        k: v for k, v in metrics[1].items() if not k.startswith("perf/")
    }
    assert m["actor/optimizer_steps"] == 2 and m["actor/skipped_steps"] == 0
    for key in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "actor/kl_loss",
    ):
        assert key in m and m[key] == m[key], key

    groups = mini_batch_groups(16, 2, cfg.actor.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    want = reference_actor_update(tiny["dir"], batch, cfg, groups)
    got = load_full_state_dict(ckpt)
    diff = max_weight_diff(got, want)
    moved = max((want[k] - hf.state_dict()[k]).abs().max().item() for k in want)
    print(
        f"\nactor: init {t_init:.1f}s, log-prob err {lp_err:.2e}, entropy err {ent_err:.2e}, rollout vs "
        f"recomputed {gen_err:.2e}, ref err {ref_err:.2e}, "
        f"weight diff {diff:.2e} (update moved weights by up to {moved:.2e}), total {time.perf_counter() - t0:.1f}s"
    )
    assert moved > 1e-3
    assert diff < WEIGHT_TOL


@pytest.mark.slow
def test_critic_values_and_update_match_single_process(tiny):
    # the critic also runs the activation-checkpointing and CPU-offload paths: same numbers expected
    cfg = make_config(tiny["dir"])
    cfg.critic.model = {"path": tiny["dir"], "enable_gradient_checkpointing": True}
    cfg.critic.fsdp.param_offload = True
    batch, tmp = tiny["batch"], tiny["tmp"]
    data_url = save_batch(batch, str(tmp / "rollout_c.arrow"))
    t0 = time.perf_counter()
    with start_group(CRITIC, cfg, 2) as group:
        infos = group.call("init_model")
        assert infos[1]["critic"]["mesh_shape"] == [2]
        assert infos[1]["critic"]["gradient_checkpointing"] and infos[1]["critic"]["param_offload"]
        values = DataProto.load(group.call("compute_values", data_url)).batch["values"]
        metrics = group.call("update_critic", data_url)
        ckpt = str(tmp / "critic_ckpt")
        group.call("save_checkpoint", ckpt)
    critic = plain_critic(tiny["dir"], cfg.seed).eval()
    mask = batch["response_mask"].bool()
    v_err = (values - plain_values(critic, batch))[mask].abs().max().item()
    assert v_err < LOGPROB_TOL, v_err
    assert (values[~mask] == 0).all()
    m = metrics[0]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in m, key
    assert m["critic/optimizer_steps"] == 2
    groups = mini_batch_groups(16, 2, cfg.critic.ppo_mini_batch_size * cfg.rollout.n // 2, 1)
    want = reference_critic_update(tiny["dir"], batch, cfg, groups)
    diff = max_weight_diff(load_full_state_dict(ckpt), want)
    print(f"\ncritic: value err {v_err:.2e}, weight diff {diff:.2e}, total {time.perf_counter() - t0:.1f}s")
    assert diff < WEIGHT_TOL


# ---------------------------------------------------------------- single process, no FSDP (fast)


def test_warmup_schedule():
    from ppoflow.infra.config import OptimConfig
    from ppoflow.workers.optim import build_optimizer

    opt, sched = build_optimizer(torch.nn.Linear(2, 2), OptimConfig(lr=1.0, warmup_steps=4))
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_training_steps"):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(warmup_steps_ratio=0.1))


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_grad_accumulation_is_exact_for_every_loss_agg_mode(tiny, mode):
    """Micro-batches of 1 row and of the whole mini-batch give the same gradient (chunk size 5
    splits the LM head into several checkpointed chunks). SGD with lr 1 makes the weight change the
    (clipped) gradient itself, so Adam's amplification of near-zero gradients stays out of it."""
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.loss_agg_mode = mode
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for micro in (1, 16):
        cfg.actor.ppo_micro_batch_size_per_gpu = micro
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        metrics = actor.update_policy(data)
        assert metrics["actor/optimizer_steps"] == 1
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7  # a few fp32 ulps of the weights (|w| < 1)


@pytest.mark.parametrize(
    "loss, mode", [("gspo", "seq-mean-token-mean"), ("gspo_token", "token-mean"), ("cispo", "token-mean")]
)
def test_grad_accumulation_is_exact_for_the_registered_policy_losses(tiny, loss, mode):
    """As above for GSPO (a loss per sequence) and CISPO: 1-row micro-batches = the whole mini-batch,
    and the loss's own metrics reach the update's (GSPO's sequence-ratio statistics)."""
    cfg = make_config(tiny["dir"], mini_batch=8)
    cfg.actor.policy_loss, cfg.actor.loss_agg_mode = loss, mode
    cfg.actor.clip_ratio_low = cfg.actor.clip_ratio_high = 0.01  # some sequences and tokens clipped
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for micro in (1, 16):
        cfg.actor.ppo_micro_batch_size_per_gpu = micro
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        metrics = actor.update_policy(data)
        assert ("actor/seq_ratio/mean" in metrics) == loss.startswith("gspo")
        assert "actor/pg_clipfrac_high" in metrics and "actor/pg_clipfrac_low" in metrics
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7


def test_non_finite_grad_norm_skips_the_step(tiny):
    cfg = make_config(tiny["dir"])
    batch = dict(tiny["batch"])
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][0, 0] = float("nan")  # a response token of row 0: every step containing it
    actor = plain_actor(tiny["dir"], cfg)
    before = {k: v.detach().clone() for k, v in actor.module.state_dict().items()}
    metrics = actor.update_policy(DataProto.from_dict(batch, meta_info={"temperature": TEMPERATURE}))
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/skipped_steps"] == 1
    assert actor.lr_scheduler.last_epoch == 1  # the schedule advances on real steps only
    after = actor.module.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert max_weight_diff(after, before) > 0  # the other mini-batch did step


def test_mini_batch_rows_cover_every_row_each_epoch():
    from ppoflow.workers.minibatch import mini_batch_rows

    plain = [r.tolist() for r in mini_batch_rows(10, 4, 2, shuffle=False, seed=0)]
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2
    shuffled = [r.tolist() for r in mini_batch_rows(10, 4, 2, shuffle=True, seed=3)]
    epochs = [sum(shuffled[:3], []), sum(shuffled[3:], [])]
    assert all(sorted(e) == list(range(10)) for e in epochs) and epochs[0] != epochs[1]


def test_update_shuffle_follows_the_iteration_not_the_call_count():
    from ppoflow.workers.minibatch import mini_batch_rows, shuffle_seed

    batch = DataProto.from_dict({"x": torch.zeros(10, 1)}, meta_info={"iteration": 7})
    first, retried = shuffle_seed(3, batch, calls=1), shuffle_seed(3, batch, calls=5)
    assert first == retried  # a recomputed or resumed update shuffles as the first one did
    rows = [r.tolist() for r in mini_batch_rows(10, 4, 1, shuffle=True, seed=first)]
    assert rows == [r.tolist() for r in mini_batch_rows(10, 4, 1, shuffle=True, seed=retried)]
    assert (
        shuffle_seed(3, DataProto.from_dict({"x": torch.zeros(10, 1)}, meta_info={"iteration": 8}), 1)
        != first
    )
    unnamed = DataProto.from_dict({"x": torch.zeros(10, 1)})
    assert shuffle_seed(3, unnamed, calls=1) != shuffle_seed(3, unnamed, calls=2)


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


@pytest.mark.parametrize("impl", ["checkpoint", "fused"])
def test_chunked_head_matches_full_log_softmax(impl):
    """Log-probs, entropy and their gradients (hidden, weight, bias) equal autograd through a full
    (N, V) log-softmax, with temperature and an entropy term, for both head implementations."""
    from ppoflow.workers.modeling import chunked_log_probs

    g = torch.Generator().manual_seed(0)
    n, h, v, t = 13, 8, 50, 0.7
    head = torch.nn.Linear(h, v)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def grads(lp, ent):
        head.zero_grad()
        hidden.grad = None
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return (
            [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()],
            lp.detach(),
            ent.detach(),
        )

    logp_all = torch.log_softmax(head(hidden) / t, dim=-1)
    want, want_lp, want_ent = grads(
        logp_all.gather(-1, labels[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)
    )
    got, lp, ent = grads(*chunked_log_probs(hidden, head, labels, t, True, True, chunk_size=5, impl=impl))
    assert (lp - want_lp).abs().max() < 1e-5 and (ent - want_ent).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item())


def test_fused_head_update_equals_checkpointed_head(tiny):
    cfg = make_config(tiny["dir"], mini_batch=8)
    data = DataProto.from_dict(tiny["batch"], meta_info={"temperature": TEMPERATURE})
    weights = []
    for impl in ("checkpoint", "fused"):
        actor = plain_actor(tiny["dir"], cfg, chunk_size=5)
        actor.module.head_impl = impl
        actor.optimizer, actor.lr_scheduler = torch.optim.SGD(actor.module.parameters(), lr=1.0), None
        actor.update_policy(data)
        weights.append({k: v.detach().clone() for k, v in actor.module.state_dict().items()})
    assert max_weight_diff(*weights) < 5e-7


def test_deterministic_updates_are_strict_inside_and_restore_the_mode_after():
    from ppoflow.workers.determinism import deterministic_updates

    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_updates(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    with deterministic_updates(False):
        assert not torch.are_deterministic_algorithms_enabled()
