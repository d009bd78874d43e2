"""ppoflow.algos.policy_losses: the registry, and GSPO, GSPO-token and CISPO against plain loops
written from each paper's equation (values and gradients, ragged masks, fully masked rows), each
reducing to the vanilla policy gradient when every ratio is 1; every loss with the rollout
correction's importance weights (each token's term times its weight); the dual clip that bounds
GSPO's loss far off policy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from tests.support.algo_reference import F64, SETTINGS, SHAPES, close, randn, random_mask

CLIPS = dict(low=st.sampled_from([0.0, 0.1, 0.2, 1.0]), high=st.sampled_from([0.0, 0.05, 0.28, 5.0]))


def _clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """clip() of the equations, on a 0-d tensor: a constant (no gradient) outside [lo, hi]."""
    if x.item() < lo:
        return torch.tensor(lo, dtype=F64)
    if x.item() > hi:
        return torch.tensor(hi, dtype=F64)
    return x


def _aggregate(per_token: list[list[torch.Tensor]], mode: str, length: int) -> torch.Tensor:
    """The loss aggregations, in loops: ``per_token[i]`` holds sequence i's valid-token losses."""
    zero = torch.zeros((), dtype=F64)
    if mode == "token-mean":
        flat = [x for seq in per_token for x in seq]
        return sum(flat, zero) / len(flat) if flat else zero
    per_seq = []
    for seq in per_token:
        if not seq:
            continue
        total = sum(seq, zero)
        per_seq.append(
            {
                "seq-mean-token-sum": total,
                "seq-mean-token-mean": total / len(seq),
                "seq-mean-token-sum-norm": total / length,
            }[mode]
        )
    return sum(per_seq, zero) / len(per_seq) if per_seq else zero


def _valid(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t] != 0]


def _dual(loss: torch.Tensor, a: float, c: float) -> torch.Tensor:
    """The dual clip: for A < 0 the loss is at most -A * c (a constant there)."""
    if a < 0 and loss.item() > -a * c:
        return torch.tensor(-a * c, dtype=F64)
    return loss


def _w(weights, i: int, t: int) -> float:
    return 1.0 if weights is None else weights[i, t].item()


def ref_gspo(old, new, adv, mask, low, high, mode, c=3.0, weights=None):
    """GSPO: s_i = (prod_t pi/pi_old)^(1/|y_i|); J = agg of min(s_i A_i, clip(s_i) A_i), the
    dual clip for A_i < 0, each token's copy times its weight."""
    per_token = []
    for i in range(old.shape[0]):
        ts = _valid(mask, i)
        if not ts:
            per_token.append([])
            continue
        s = torch.exp(sum((new[i, t] - old[i, t] for t in ts), torch.zeros((), dtype=F64)) / len(ts))
        a = sum(adv[i, t].item() for t in ts) / len(ts)
        seq_loss = _dual(-min(s * a, _clip(s, 1 - low, 1 + high) * a, key=lambda x: x.item()), a, c)
        per_token.append([seq_loss * _w(weights, i, t) for t in ts])
    return _aggregate(per_token, mode, old.shape[1])


def ref_gspo_token(old, new, adv, mask, low, high, mode, c=3.0, weights=None):
    """GSPO-token: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]; min(s_i,t A_t, clip(s_i,t) A_t) per
    token, the dual clip for A_t < 0, times the token's weight."""
    per_token = []
    for i in range(old.shape[0]):
        ts = _valid(mask, i)
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in ts) / len(ts)) if ts else 1.0
        row = []
        for t in ts:
            s_t = s * torch.exp(new[i, t] - new[i, t].detach())
            a = adv[i, t].item()
            term = _dual(-min(s_t * a, _clip(s_t, 1 - low, 1 + high) * a, key=lambda x: x.item()), a, c)
            row.append(term * _w(weights, i, t))
        per_token.append(row)
    return _aggregate(per_token, mode, old.shape[1])


def ref_cispo(old, new, adv, mask, low, high, mode, c=3.0, weights=None):
    """CISPO: J = agg of sg(clip(r_t, 1 - low, 1 + high)) * A_t * log pi(y_t), times the weight."""
    per_token = []
    for i in range(old.shape[0]):
        row = []
        for t in _valid(mask, i):
            r = math.exp(new[i, t].item() - old[i, t].item())
            w = min(max(r, 1 - low), 1 + high)
            row.append(-w * adv[i, t].item() * new[i, t] * _w(weights, i, t))
        per_token.append(row)
    return _aggregate(per_token, mode, old.shape[1])


def ref_vanilla(old, new, adv, mask, low, high, mode, c=3.0, weights=None):
    """PPO: max(-A r_t, -A clip(r_t, 1 - low, 1 + high)), the dual clip for A < 0, times the weight."""
    per_token = []
    for i in range(old.shape[0]):
        row = []
        for t in _valid(mask, i):
            r = torch.exp(new[i, t] - old[i, t])
            a = adv[i, t].item()
            term = _dual(-min(r * a, _clip(r, 1 - low, 1 + high) * a, key=lambda x: x.item()), a, c)
            row.append(term * _w(weights, i, t))
        per_token.append(row)
    return _aggregate(per_token, mode, old.shape[1])


REFERENCES = {"gspo": ref_gspo, "gspo_token": ref_gspo_token, "cispo": ref_cispo}
WEIGHTED_REFERENCES = {**REFERENCES, "vanilla": ref_vanilla}


def _case(seed: int, batch: int, length: int, seq_adv: bool):
    gen = torch.Generator().manual_seed(seed)
    old = randn(gen, batch, length) - 1.0
    new = (old + 0.3 * randn(gen, batch, length)).requires_grad_(True)
    adv = randn(gen, batch, length)
    if seq_adv:  # outcome estimators: one advantage per sequence
        adv = adv[:, :1].expand(batch, length).clone()
    return old, new, adv, random_mask(gen, batch, length)


@SETTINGS
@given(
    **SHAPES,
    **CLIPS,
    name=st.sampled_from(sorted(REFERENCES)),
    mode=st.sampled_from(LOSS_AGG_MODES),
    seq_adv=st.booleans(),
)
def test_loss_matches_paper_reference(seed, batch, length, low, high, name, mode, seq_adv):
    old, new, adv, mask = _case(seed, batch, length, seq_adv)
    loss, metrics = get_policy_loss(name)(
        old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode
    )
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    new_ref = new.detach().clone().requires_grad_(True)
    expected = REFERENCES[name](old, new_ref, adv, mask, low, high, mode)
    close(loss, expected.item())
    ref_grad = torch.autograd.grad(expected, new_ref)[0] if expected.requires_grad else torch.zeros_like(new)
    close(torch.zeros_like(new) if grad is None else grad, ref_grad)
    assert 0.0 <= metrics["pg_clipfrac_low"] <= metrics["pg_clipfrac"] <= 1.0
    assert 0.0 <= metrics["pg_clipfrac_high"] <= metrics["pg_clipfrac"] <= 1.0


def test_fully_masked_rows_get_no_gradient_and_count_nowhere():
    """Row 1 is fully masked: its huge log-ratio neither changes the loss nor gets a gradient."""
    old = torch.tensor([[-1.0, -2.0, -1.5], [-1.0, -1.0, -1.0]], dtype=F64)
    new = torch.tensor([[-0.9, -2.1, -1.4], [9.0, 9.0, 9.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-5.0, -5.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    for name in sorted(REFERENCES):
        for mode in LOSS_AGG_MODES:
            loss, _ = get_policy_loss(name)(old, new, adv, mask, loss_agg_mode=mode)
            alone, _ = get_policy_loss(name)(old[:1], new[:1], adv[:1], mask[:1], loss_agg_mode=mode)
            close(loss, alone.item())
            (grad,) = torch.autograd.grad(loss, new)
            assert torch.all(grad[1] == 0) and torch.all(grad[0, 2] == 0), (name, mode, grad)
    all_masked = torch.zeros_like(mask)
    for name in POLICY_LOSSES:
        loss, _ = get_policy_loss(name)(old, new, adv, all_masked)
        assert loss.item() == 0.0, name


@SETTINGS
@given(**SHAPES, name=st.sampled_from(sorted(POLICY_LOSSES)), mode=st.sampled_from(LOSS_AGG_MODES))
def test_ratio_one_gives_the_vanilla_policy_gradient(seed, batch, length, name, mode):
    """On-policy (log_prob == old_log_prob, every ratio 1) each loss's gradient is the policy
    gradient -A * grad log pi, aggregated: with one advantage per sequence (GSPO's A_i) for all."""
    gen = torch.Generator().manual_seed(seed)
    logp = (randn(gen, batch, length) - 1.0).requires_grad_(True)
    adv = randn(gen, batch, 1).expand(batch, length).clone()
    mask = random_mask(gen, batch, length)
    loss, metrics = get_policy_loss(name)(
        logp.detach(), logp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode=mode
    )
    (grad,) = torch.autograd.grad(loss, logp)
    # the policy gradient: agg over valid tokens of -A_t * log pi_t, differentiated
    pg = logp.detach().clone().requires_grad_(True)
    rows = [[-adv[i, t].item() * pg[i, t] for t in _valid(mask, i)] for i in range(batch)]
    expected = _aggregate(rows, mode, length)
    ref_grad = torch.autograd.grad(expected, pg)[0] if expected.requires_grad else torch.zeros_like(pg)
    close(grad, ref_grad)
    assert metrics["pg_clipfrac"].item() == 0.0
    close(metrics["ppo_kl"], 0.0)


def test_gspo_token_equals_gspo_with_sequence_advantages_but_not_per_token():
    gen = torch.Generator().manual_seed(3)
    old, new, adv, mask = _case(3, 4, 6, seq_adv=True)
    mode = "seq-mean-token-mean"
    grads = []
    for name in ("gspo", "gspo_token"):
        loss, _ = get_policy_loss(name)(old, new, adv, mask, clip_ratio_low=0.5, clip_ratio_high=0.5)
        grads.append(torch.autograd.grad(loss, new)[0])
    close(grads[0], grads[1])
    token_adv = randn(gen, 4, 6)
    a, _ = get_policy_loss("gspo")(old, new, token_adv, mask, loss_agg_mode=mode)
    b, _ = get_policy_loss("gspo_token")(old, new, token_adv, mask, loss_agg_mode=mode)
    ga, gb = torch.autograd.grad(a, new)[0], torch.autograd.grad(b, new)[0]
    assert not torch.allclose(ga, gb)


def test_sequence_ratio_is_the_geometric_mean_and_clips_whole_sequences():
    old = torch.zeros(2, 3, dtype=F64)
    new = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.0, 1.0, 1.0]], dtype=F64))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    adv = torch.ones(2, 3, dtype=F64)
    _, m = get_policy_loss("gspo")(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(m["seq_ratio/max"], 4.0 ** (1 / 3))  # (2 * 0.5 * 4)^(1/3)
    close(m["seq_ratio/min"], 1.0)
    close(m["pg_clipfrac_high"], 0.5)  # one of two sequences above 1.2 with A > 0
    close(m["pg_clipfrac_low"], 0.0)


def test_vanilla_is_compute_policy_loss_with_per_side_clip_fractions():
    old = torch.zeros(1, 4, dtype=F64)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]], dtype=F64))
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    loss, m = get_policy_loss("vanilla")(old, new, adv, mask)
    close(loss, compute_policy_loss(old, new, adv, mask)[0].item())
    close(m["pg_clipfrac_high"], 0.25)  # token 0: A > 0, ratio 1.5 > 1.2
    close(m["pg_clipfrac_low"], 0.25)  # token 1: A < 0, ratio 0.5 < 0.8
    close(m["pg_clipfrac"], 0.5)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO drops a token whose ratio left the trust region; CISPO keeps it with a bounded weight."""
    old = torch.zeros(1, 1, dtype=F64)
    new = torch.tensor([[math.log(3.0)]], dtype=F64, requires_grad=True)
    adv = torch.ones(1, 1, dtype=F64)
    mask = torch.ones(1, 1, dtype=F64)
    ppo, _ = get_policy_loss("vanilla")(old, new, adv, mask)
    cispo, m = get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=1.0, clip_ratio_high=0.28)
    assert torch.autograd.grad(ppo, new)[0].item() == 0.0
    close(torch.autograd.grad(cispo, new)[0], [[-1.28]])
    close(m["pg_clipfrac_high"], 1.0)


def test_registry_rejects_a_second_function_under_a_taken_name_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("gspo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'; known: cispo, gspo"):
        get_policy_loss("nope")


@SETTINGS
@given(
    **SHAPES,
    **CLIPS,
    name=st.sampled_from(sorted(WEIGHTED_REFERENCES)),
    mode=st.sampled_from(LOSS_AGG_MODES),
    seq_adv=st.booleans(),
)
def test_rollout_is_weights_multiply_each_tokens_term(seed, batch, length, low, high, name, mode, seq_adv):
    """Every registered loss with the rollout correction's weights: each token's term times its
    weight, then the same aggregation (the counts do not change), against the plain loops."""
    old, new, adv, mask = _case(seed, batch, length, seq_adv)
    gen = torch.Generator().manual_seed(seed + 1)
    weights = torch.rand(batch, length, generator=gen, dtype=F64) * 2.0
    weights[torch.rand(batch, length, generator=gen) < 0.2] = 0.0
    loss, _ = get_policy_loss(name)(
        old,
        new,
        adv,
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
        loss_agg_mode=mode,
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, new, allow_unused=True)
    new_ref = new.detach().clone().requires_grad_(True)
    expected = WEIGHTED_REFERENCES[name](old, new_ref, adv, mask, low, high, mode, weights=weights)
    close(loss, expected.item())
    ref_grad = torch.autograd.grad(expected, new_ref)[0] if expected.requires_grad else torch.zeros_like(new)
    close(torch.zeros_like(new) if grad is None else grad, ref_grad)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_weights_of_one_change_nothing_and_carry_no_gradient(name):
    old, new, adv, mask = _case(11, 4, 5, seq_adv=False)
    plain, _ = get_policy_loss(name)(old, new, adv, mask)
    (plain_grad,) = torch.autograd.grad(plain, new)
    weights = torch.ones_like(old).requires_grad_(True)
    ones, _ = get_policy_loss(name)(old, new, adv, mask, rollout_is_weights=weights)
    grads = torch.autograd.grad(ones, [new, weights], allow_unused=True)
    assert ones.item() == plain.item()
    assert torch.equal(grads[0], plain_grad) and grads[1] is None  # the weights are constants


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gspo_token"])
@pytest.mark.parametrize("log_ratio", [3.0, 15.0, 25.0])
def test_far_off_policy_negative_advantage_is_bounded_by_the_dual_clip(name, log_ratio):
    """A sequence sampled far from the current policy (every token's log-ratio ``log_ratio``, past
    the +-20 clamp at 25) with a negative advantage: the loss is at most |A| * clip_ratio_c and no
    gradient flows (without the dual clip GSPO gave |A| * e^log_ratio and a gradient to match)."""
    old = torch.zeros(1, 4, dtype=F64)
    new = torch.full((1, 4), log_ratio, dtype=F64, requires_grad=True)
    adv = torch.full((1, 4), -2.0, dtype=F64)
    mask = torch.ones(1, 4, dtype=F64)
    loss, metrics = get_policy_loss(name)(old, new, adv, mask, clip_ratio_c=3.0)
    (grad,) = torch.autograd.grad(loss, new)
    close(loss, 2.0 * 3.0)
    assert torch.all(grad == 0), grad
    close(metrics["pg_clipfrac_lower"], 1.0)
    # a ratio within the dual bound keeps its gradient: exp(1) < 3
    near = torch.full((1, 4), 1.0, dtype=F64, requires_grad=True)
    loss, metrics = get_policy_loss(name)(old, near, adv, mask, clip_ratio_c=3.0)
    close(loss, 2.0 * math.e)
    assert torch.all(torch.autograd.grad(loss, near)[0] != 0)
    close(metrics["pg_clipfrac_lower"], 0.0)
