"""ppoflow.algos.kl: KL penalty kinds and the fixed and adaptive KL controllers, against plain-Python references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppoflow.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    get_kl_controller,
    kl_penalty,
)
from tests.support.algo_reference import (
    F64,
    SETTINGS,
    SHAPES,
    close,
    randn,
    random_mask,
    rows,
)


def ref_kl(lp: float, ref: float, kind: str) -> float:
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref) ** 2
    x = ref - lp
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


@SETTINGS
@given(**SHAPES, kind=st.sampled_from(["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]))
def test_kl_penalty_kinds_match_reference(seed, batch, length, kind):
    gen = torch.Generator().manual_seed(seed)
    logprob, ref = randn(gen, batch, length) * 2, randn(gen, batch, length) * 2
    out = kl_penalty(logprob, ref, kind)
    lp, rf = rows(logprob), rows(ref)
    close(out, [[ref_kl(lp[b][t], rf[b][t], kind) for t in range(length)] for b in range(batch)])


def test_kl_penalty_low_var_clamp_and_unknown_kind():
    logprob = torch.tensor([[-20.0, 0.0, -1.0]], dtype=F64)
    ref = torch.tensor([[0.0, -20.0, -1.0]], dtype=F64)
    out = kl_penalty(logprob, ref, "low_var_kl")
    close(out, [[10.0, 10.0, 0.0]])  # exp(20) - 21 and 19 + exp(-20) both clamp to 10
    assert (kl_penalty(torch.randn(4, 5), torch.randn(4, 5), "k3") >= 0).all()
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logprob, ref, "full")


def test_fixed_kl_controller():
    ctrl = get_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    for kl in (0.0, 10.0, -3.0):
        ctrl.update(kl, n_steps=64)
        assert ctrl.value == 0.05


def test_adaptive_kl_controller_over_updates():
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # kl 9: error 0.5 clipped to 0.2 -> x (1 + 0.2 * 256 / 10000) = x 1.00512
    ctrl.update(current_kl=9.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.100512, rel=1e-12)
    # kl 3: error -0.5 clipped to -0.2 -> x 0.99488
    ctrl.update(current_kl=3.0, n_steps=256)
    assert ctrl.value == pytest.approx(0.09999737856, rel=1e-12)
    # kl 6.6: error 0.1 (inside the clip) -> x (1 + 0.1 * 1000 / 10000) = x 1.01
    ctrl.update(current_kl=6.6, n_steps=1000)
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)
    # kl on target: unchanged
    ctrl.update(current_kl=6.0, n_steps=5000)
    assert ctrl.value == pytest.approx(0.1009973523456, rel=1e-12)


def test_get_kl_controller_kinds_and_errors():
    ctrl = get_kl_controller("adaptive", kl_coef=0.2, target_kl=1.0, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2
    ctrl = get_kl_controller("adaptive", init_kl_coef=0.3, target_kl=1.0, horizon=100)
    assert ctrl.value == 0.3
    for kind in ("fixed", "adaptive"):  # one config section serves both kinds
        ctrl = get_kl_controller(kind, kl_coef=0.4, target_kl=1.0, horizon=100)
        assert ctrl.value == 0.4
    with pytest.raises(TypeError):
        get_kl_controller("fixed", kl_coef=0.1, target=1.0)
    with pytest.raises(TypeError):
        get_kl_controller("adaptive", kl_coef=0.1, init_kl_coef=0.1, target_kl=1.0, horizon=10)
    with pytest.raises(ValueError, match="adaptive, fixed"):
        get_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_apply_kl_penalty_matches_reference(kind, adaptive):
    gen = torch.Generator().manual_seed(11)
    batch, length = 5, 6
    scores = randn(gen, batch, length)
    old, ref = randn(gen, batch, length), randn(gen, batch, length)
    mask = random_mask(gen, batch, length)
    mask[2] = 0.0  # one empty response
    mask[0, 3] = 0.0
    ctrl = AdaptiveKLController(0.1, target_kl=0.5, horizon=100) if adaptive else FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kind)

    s, o, r, m = rows(scores), rows(old), rows(ref), rows(mask)
    expected, seq_kls = [], []
    for b in range(batch):
        kls = [ref_kl(o[b][t], r[b][t], kind) for t in range(length)]
        expected.append([s[b][t] - 0.1 * kls[t] if m[b][t] else s[b][t] for t in range(length)])
        valid = [k for k, mm in zip(kls, m[b]) if mm]
        if valid:
            seq_kls.append(sum(valid) / len(valid))
    current_kl = sum(seq_kls) / len(seq_kls)
    close(rewards, expected)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1
    if adaptive:
        err = min(max(current_kl / 0.5 - 1.0, -0.2), 0.2)
        assert ctrl.value == pytest.approx(0.1 * (1.0 + err * batch / 100), rel=1e-12)
    else:
        assert ctrl.value == 0.1


def test_which_estimator_as_a_loss_has_the_reverse_kls_gradient():
    """Why the teacher's loss term defaults to k2: on the policy's own samples, the expected
    gradient of k2(log pi(y) - log t(y)) is the gradient of KL(pi || t), k3's is that of KL(t || pi),
    k1's is zero; and the distill estimator's advantage (teacher_rewards, detached) in the policy
    gradient gives -coef x the reverse KL's. Exact expectations over a categorical's 5 outcomes,
    against autograd of the closed-form KLs."""
    from ppoflow.algos import teacher_rewards

    gen = torch.Generator().manual_seed(0)
    # mild distributions: k3's clamp at 10 (a teacher 30x likelier than pi, say) has no gradient
    logits = (0.5 * torch.randn(5, generator=gen, dtype=F64)).requires_grad_()
    log_t = torch.log_softmax(0.5 * torch.randn(5, generator=gen, dtype=F64), -1)

    def grad(f):
        (g,) = torch.autograd.grad(f(), logits)
        return g

    def expected(per_token):  # E_{y~pi}[d/dlogits per_token(y)], pi held fixed in the expectation
        def f():
            log_p = torch.log_softmax(logits, -1)
            return (log_p.exp().detach() * per_token(log_p)).sum()

        return grad(f)

    reverse = grad(
        lambda: (torch.log_softmax(logits, -1).exp() * (torch.log_softmax(logits, -1) - log_t)).sum()
    )
    forward = grad(lambda: (log_t.exp() * (log_t - torch.log_softmax(logits, -1))).sum())
    close(expected(lambda lp: kl_penalty(lp, log_t, "k2")), reverse)
    close(expected(lambda lp: kl_penalty(lp, log_t, "k3")), forward)
    close(expected(lambda lp: kl_penalty(lp, log_t, "k1")), torch.zeros(5, dtype=F64))
    mask = torch.ones(5, dtype=F64)
    adv = teacher_rewards(torch.log_softmax(logits, -1).detach(), log_t, mask, coef=0.5)
    close(expected(lambda lp: -adv * lp), 0.5 * reverse)
