"""RL math against hand-computed values (the arithmetic is in the comments)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tmax.rl import (
    GroupAdvantages,
    batch_metrics,
    binary_kl,
    binary_tv,
    dppo_loss,
    dppo_mask,
    entropy_from_logits,
    filter_groups,
    group_advantages,
    grpo_clip_loss,
    infra_mask,
    logprob_gap,
    masked_mean,
    token_logprobs,
)
from tmax.rollout.trajectory import Trajectory

F64 = torch.float64


def lp(probs) -> torch.Tensor:
    """Log of a nested list of probabilities, float64."""
    return torch.tensor(probs, dtype=F64).log()


# ---------------------------------------------------------------- group advantages


def test_centered_advantages():
    # mean(1,0,1,0) = 0.5 -> A = r - 0.5
    g = group_advantages([1.0, 0.0, 1.0, 0.0], [True] * 4)
    assert g == GroupAdvantages((0.5, -0.5, 0.5, -0.5), kept=True, reason="ok", n_valid=4)


def test_std_normalized_advantages():
    # population std = sqrt(mean((r - 0.5)^2)) = sqrt(0.25) = 0.5 -> A = +-0.5 / (0.5 + eps)
    eps = 1e-6
    g = group_advantages([1.0, 0.0, 1.0, 0.0], [True] * 4, normalize_std=True, eps=eps)
    a = 0.5 / (0.5 + eps)  # = 0.999998
    assert g.kept and g.advantages == pytest.approx((a, -a, a, -a), abs=1e-12)
    assert a == pytest.approx(1.0, abs=1e-5)


def test_infra_failed_rollout_excluded():
    # valid rewards 1, 0, 0 -> mean 1/3 -> A = 2/3, -, -1/3, -1/3 (not 1/4-based)
    g = group_advantages([1.0, None, 0.0, 0.0], [True, False, True, True])
    assert g.kept and g.n_valid == 3 and g.advantages[1] is None
    assert g.advantages[0] == pytest.approx(2 / 3)
    assert g.advantages[2] == pytest.approx(-1 / 3)
    assert g.advantages[3] == pytest.approx(-1 / 3)


def test_infra_failed_reward_is_ignored_even_if_present():
    # an invalid rollout's reward (say a fake 0.0) must not move the mean: mean(1, 0) = 0.5
    g = group_advantages([1.0, 0.0, 0.0], [True, False, True])
    assert g.advantages == (0.5, None, -0.5)


def test_too_few_valid():
    g = group_advantages([1.0, None, None, None], [True, False, False, False])
    assert g == GroupAdvantages((None,) * 4, kept=False, reason="too_few_valid", n_valid=1)
    g = group_advantages([None, None], [False, False])
    assert g.reason == "too_few_valid" and g.n_valid == 0
    # min_valid is honored: 3 valid < 4
    assert group_advantages([1.0, 0.0, 0.0], [True] * 3, min_valid=4).reason == "too_few_valid"


def test_zero_std():
    g = group_advantages([1.0, 1.0, None, 1.0], [True, True, False, True])
    assert g == GroupAdvantages((None,) * 4, kept=False, reason="zero_std", n_valid=3)
    assert group_advantages([0.0] * 4, [True] * 4).reason == "zero_std"
    # 0.1 is inexact in binary: the mean may differ from 0.1 by ~1e-17, still zero std
    assert group_advantages([0.1] * 3, [True] * 3).reason == "zero_std"
    # a tiny real spread is kept
    assert group_advantages([0.5, 0.5 + 1e-9], [True, True]).kept


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="length"):
        group_advantages([1.0, 0.0], [True])
    with pytest.raises(ValueError, match="no reward"):
        group_advantages([1.0, None], [True, True])
    with pytest.raises(ValueError, match=r"outside \[0,1\]"):
        group_advantages([1.5, 0.0], [True, True])
    with pytest.raises(ValueError, match=r"outside \[0,1\]"):
        group_advantages([-0.1, 0.0], [True, True])
    with pytest.raises(ValueError, match=r"outside \[0,1\]"):
        group_advantages([math.nan, 0.0], [True, True])


def test_infra_mask_and_filter_groups():
    ok = Trajectory(task="t", policy="p")
    bad = Trajectory(task="t", policy="p", infra_failure={"cause": "node_lost"})
    assert infra_mask([ok, bad, SimpleNamespace(infra_failure=None)]) == [True, False, True]
    groups = [
        group_advantages([1.0, 0.0], [True, True]),
        group_advantages([1.0, 1.0], [True, True]),
        group_advantages([0.0, 1.0], [True, True]),
    ]
    assert filter_groups(groups) == [0, 2]


# ---------------------------------------------------------------- divergences


def test_binary_tv_and_kl_values():
    mu = lp([0.5, 0.5, 0.5, 0.5, 0.3])
    pi = lp([0.7, 0.55, 0.8, 0.5, 0.6])
    # |mu - pi|
    assert binary_tv(pi, mu).tolist() == pytest.approx([0.2, 0.05, 0.3, 0.0, 0.3])
    # KL(Ber(0.5)||Ber(pi)) = 0.5 ln(0.5/pi) + 0.5 ln(0.5/(1-pi)) = 0.5 ln(0.25 / (pi (1-pi)))
    #   pi=0.7:  0.5 ln(0.25/0.21)   = 0.5 * 0.174353 = 0.0871767
    #   pi=0.55: 0.5 ln(0.25/0.2475) = 0.5 * 0.0100503 = 0.00502517
    #   pi=0.8:  0.5 ln(0.25/0.16)   = 0.5 * 0.446287 = 0.223144
    # KL(Ber(0.3)||Ber(0.6)) = 0.3 ln(0.3/0.6) + 0.7 ln(0.7/0.4)
    #                        = 0.3 * -0.693147 + 0.7 * 0.559616 = 0.183787
    expected = [0.0871767, 0.00502517, 0.223144, 0.0, 0.183787]
    assert binary_kl(pi, mu).tolist() == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_binary_kl_is_finite_at_probability_one():
    # mu = 1 (old_logp = 0) would give (1-mu) log(0/...) = 0 * -inf without the clamp
    kl = binary_kl(torch.tensor([math.log(0.5), 0.0]), torch.tensor([0.0, math.log(0.5)]))
    assert torch.isfinite(kl).all()
    # KL(Ber(1)||Ber(0.5)) = ln 2; with clamp 1e-6 the value moves by ~1e-5
    assert kl[0].item() == pytest.approx(math.log(2), abs=1e-4)


# ---------------------------------------------------------------- DPPO trust mask

# mu = 0.5 throughout; pi chosen so that r = pi/mu and the divergence are:
#   pi=0.7:  r=1.4 > 1, tv 0.2  > 0.1       pi=0.55: r=1.1 > 1, tv 0.05 < 0.1
#   pi=0.3:  r=0.6 < 1, tv 0.2  > 0.1       pi=0.45: r=0.9 < 1, tv 0.05 < 0.1
# masked iff div > delta and ((A > 0 and r > 1) or (A < 0 and r < 1))
TV_TABLE = [
    # (A,   pi,   kept)
    (1.0, 0.7, False),  # A>0, r>1, above -> pushes further out: masked
    (1.0, 0.55, True),  # A>0, r>1, below
    (1.0, 0.3, True),  # A>0, r<1, above -> update pulls it back: kept
    (1.0, 0.45, True),  # A>0, r<1, below
    (-1.0, 0.7, True),  # A<0, r>1, above -> pulls back: kept
    (-1.0, 0.55, True),  # A<0, r>1, below
    (-1.0, 0.3, False),  # A<0, r<1, above -> pushes further out: masked
    (-1.0, 0.45, True),  # A<0, r<1, below
]


@pytest.mark.parametrize("adv, pi, kept", TV_TABLE)
def test_dppo_mask_tv_truth_table(adv, pi, kept):
    keep = dppo_mask(lp([[pi]]), lp([[0.5]]), torch.tensor([adv]), delta=0.1)
    assert keep.dtype == torch.bool and keep.tolist() == [[kept]]


# KL(Ber(0.5)||Ber(pi)) = 0.5 ln(0.25 / (pi (1-pi))):
#   pi=0.8 or 0.2:   0.5 ln(0.25/0.16)   = 0.223144 > 0.1   (r = 1.6 / 0.4)
#   pi=0.55 or 0.45: 0.5 ln(0.25/0.2475) = 0.005025 < 0.1   (r = 1.1 / 0.9)
# (pi=0.7 would give 0.0872 < 0.1: the KL table needs pi further out than the TV table.)
KL_TABLE = [
    (1.0, 0.8, False),
    (1.0, 0.55, True),
    (1.0, 0.2, True),
    (1.0, 0.45, True),
    (-1.0, 0.8, True),
    (-1.0, 0.55, True),
    (-1.0, 0.2, False),
    (-1.0, 0.45, True),
]


@pytest.mark.parametrize("adv, pi, kept", KL_TABLE)
def test_dppo_mask_kl_truth_table(adv, pi, kept):
    keep = dppo_mask(lp([[pi]]), lp([[0.5]]), torch.tensor([adv]), delta=0.1, divergence="kl")
    assert keep.tolist() == [[kept]]


def test_dppo_mask_tv_and_kl_disagree_where_expected():
    # pi=0.7: tv 0.2 > 0.1 (masked) but kl 0.0872 < 0.1 (kept), A>0, r>1
    args = (lp([[0.7]]), lp([[0.5]]), torch.tensor([1.0]))
    assert dppo_mask(*args, divergence="tv").item() is False
    assert dppo_mask(*args, divergence="kl").item() is True


def test_dppo_mask_zero_advantage_and_bad_divergence():
    assert dppo_mask(lp([[0.9]]), lp([[0.1]]), torch.tensor([0.0])).item() is True
    with pytest.raises(ValueError, match="divergence"):
        dppo_mask(lp([[0.9]]), lp([[0.1]]), torch.tensor([1.0]), divergence="js")


# ---------------------------------------------------------------- DPPO loss

# Hand-made batch, B=2, T=3, delta=0.1 (tv), mu = 0.5 except one padded token.
#   seq 0, A=+1:   pi = 0.55 (r 1.1, tv .05 kept)  -> r A = +1.1
#                  pi = 0.7  (r 1.4, tv .2, A>0 r>1 masked) -> 0
#                  pi = 0.3  (r 0.6, tv .2, A>0 r<1 kept)   -> r A = +0.6
#   seq 1, A=-0.5: pi = 0.3  (r 0.6, tv .2, A<0 r<1 masked) -> 0
#                  pi = 0.7  (r 1.4, tv .2, A<0 r>1 kept)   -> r A = -0.7
#                  loss_mask 0 (observation/padding)        -> not counted
#   sum = 1.1 + 0.6 - 0.7 = 1.0, N = 5 response tokens, loss = -1.0 / 5 = -0.2
MU = [[0.5, 0.5, 0.5], [0.5, 0.5, 0.9]]
PI = [[0.55, 0.7, 0.3], [0.3, 0.7, 0.2]]
ADV = [1.0, -0.5]
MASK = [[1, 1, 1], [1, 1, 0]]


def batch():
    logp = lp(PI).requires_grad_(True)
    return logp, lp(MU), torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64)


def test_dppo_loss_hand_value_and_stats():
    logp, old, adv, mask = batch()
    loss, stats = dppo_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-0.2)
    assert stats["kept_fraction"] == pytest.approx(3 / 5)
    assert stats["masked_tokens"] == 2
    # ratios over the 5 response tokens: 1.1, 1.4, 0.6, 0.6, 1.4 -> mean 5.1/5 = 1.02
    assert stats["ratio_mean"] == pytest.approx(1.02)
    assert stats["ratio_max"] == pytest.approx(1.4)
    assert stats["capped_fraction"] == 0.0


def test_dppo_loss_sign_of_advantage_matters():
    # A negated: seq 0, A=-1: 1.1 kept -> -1.1; 1.4 (A<0, r>1) kept -> -1.4; 0.6 (A<0, r<1,
    # tv .2) masked. seq 1, A=+0.5: 0.6 (A>0, r<1) kept -> +0.3; 1.4 (A>0, r>1) masked.
    # sum = -1.1 - 1.4 + 0.3 = -2.2 -> loss = 2.2 / 5 = 0.44 (not +0.2: a swapped sign shows)
    logp, old, adv, mask = batch()
    loss, stats = dppo_loss(logp, old, -adv, mask)
    assert loss.item() == pytest.approx(0.44)
    assert stats["masked_tokens"] == 2


def test_dppo_loss_per_token_advantages_match_per_sequence():
    logp, old, adv, mask = batch()
    a, _ = dppo_loss(logp, old, adv, mask)
    b, _ = dppo_loss(logp, old, adv.unsqueeze(-1).expand(2, 3).clone(), mask)
    assert a.item() == pytest.approx(b.item())


def test_dppo_loss_gradient_by_hand():
    # dL/dlogp_t = -m_t keep_t r_t A_t / N  (d r / d logp = r)
    #   (0,0): -(1)(1)(1.1)(1)/5 = -0.22     (0,1): masked -> 0     (0,2): -(0.6)(1)/5 = -0.12
    #   (1,0): masked -> 0    (1,1): -(1.4)(-0.5)/5 = +0.14         (1,2): loss_mask 0 -> 0
    logp, old, adv, mask = batch()
    loss, _ = dppo_loss(logp, old, adv, mask)
    loss.backward()
    expected = [[-0.22, 0.0, -0.12], [0.0, 0.14, 0.0]]
    assert logp.grad.tolist()[0] == pytest.approx(expected[0])
    assert logp.grad.tolist()[1] == pytest.approx(expected[1])


def test_dppo_loss_gradcheck():
    logp, old, adv, mask = batch()  # no token near the cap or the delta boundary
    assert torch.autograd.gradcheck(
        lambda x: dppo_loss(x, old, adv, mask)[0], (logp,), eps=1e-6, atol=1e-8
    )


def test_dropped_rollout_not_in_denominator():
    logp, old, adv, mask = batch()
    loss, _ = dppo_loss(logp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, logp)
    # a third, infra-failed sequence: loss_mask all 0, garbage values (huge ratio, NaN)
    logp3 = torch.cat([logp.detach(), torch.tensor([[0.0, 0.0, 0.0]], dtype=F64)])
    logp3.requires_grad_(True)
    old3 = torch.cat([old, torch.tensor([[-100.0, math.nan, 0.0]], dtype=F64)])
    adv3 = torch.cat([adv, torch.tensor([5.0], dtype=F64)])
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=F64)])
    loss3, stats3 = dppo_loss(logp3, old3, adv3, mask3)
    (grad3,) = torch.autograd.grad(loss3, logp3)
    assert loss3.item() == pytest.approx(loss.item())  # still -1.0 / 5
    assert torch.allclose(grad3[:2], grad) and grad3[2].tolist() == [0.0, 0.0, 0.0]
    assert stats3["ratio_max"] == pytest.approx(1.4) and stats3["masked_tokens"] == 2


def test_dppo_loss_explicit_token_count():
    # micro-batch of a larger batch with 10 response tokens in all: -1.0 / 10 = -0.1
    logp, old, adv, mask = batch()
    loss, _ = dppo_loss(logp, old, adv, mask, n_tokens=10)
    assert loss.item() == pytest.approx(-0.1)
    loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.1 / 10)
    with pytest.raises(ValueError, match="n_tokens"):
        dppo_loss(logp, old, adv, mask, n_tokens=0)


def test_dppo_loss_empty_batch_is_zero():
    logp, old, adv, _ = batch()
    loss, stats = dppo_loss(logp, old, adv, torch.zeros(2, 3, dtype=F64))
    assert loss.item() == 0.0 and stats["kept_fraction"] == 0.0


def test_ratio_cap():
    # mu = 0.01, pi = 0.5 -> r = 50, capped at 10. delta=1 so the trust mask keeps it.
    # A = +1: contribution 10 * 1 -> loss = -10 / 1; the cap removes the gradient.
    logp = lp([[0.5]]).requires_grad_(True)
    loss, stats = dppo_loss(logp, lp([[0.01]]), torch.tensor([1.0], dtype=F64),
                            torch.ones(1, 1, dtype=F64), delta=1.0, ratio_cap=10.0)
    assert loss.item() == pytest.approx(-10.0)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert stats["capped_fraction"] == 1.0 and stats["ratio_max"] == pytest.approx(50.0)
    # A = -1 with the default delta: tv 0.49 > 0.1 but A<0, r>1 pulls back -> kept, +10
    loss, _ = dppo_loss(lp([[0.5]]), lp([[0.01]]), torch.tensor([-1.0], dtype=F64),
                        torch.ones(1, 1, dtype=F64))
    assert loss.item() == pytest.approx(10.0)


def test_huge_ratio_stays_finite():
    # log-ratio 200 in float32: exp would overflow, the cap on the log-ratio keeps it finite
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = dppo_loss(logp, torch.tensor([[-200.0]]), torch.tensor([-1.0]), torch.ones(1, 1))
    loss.backward()
    assert loss.item() == pytest.approx(10.0) and logp.grad.item() == 0.0


def test_loss_shape_mismatch():
    logp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="shapes"):
        dppo_loss(logp, old[:, :2], adv, mask)


# ---------------------------------------------------------------- GRPO clip baseline


def test_grpo_clip_loss_hand_values():
    # eps = 0.2, clip range [0.8, 1.2]; per token min(r A, clip(r) A):
    #   r=1.5, A=+1: min(1.5, 1.2)   = 1.2   (clipped, no grad)
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8  (clipped, no grad)
    #   r=0.5, A=+1: min(0.5, 0.8)   = 0.5   (unclipped, grad -r A / N = -0.5/4 = -0.125)
    #   r=1.5, A=-1: min(-1.5, -1.2) = -1.5  (unclipped, grad -r A / N = +1.5/4 = 0.375)
    #   sum = 1.2 - 0.8 + 0.5 - 1.5 = -0.6 -> loss = 0.6 / 4 = 0.15
    old = lp([[0.4], [0.4], [0.4], [0.4]])
    logp = lp([[0.6], [0.2], [0.2], [0.6]]).requires_grad_(True)  # r = 1.5, 0.5, 0.5, 1.5
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64)
    loss, stats = grpo_clip_loss(logp, old, adv, torch.ones(4, 1, dtype=F64), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.15)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.125, 0.375])
    assert stats["clip_fraction"] == pytest.approx(0.5)
    # single tokens: r=1.5, A=1 -> loss -1.2; r=0.5, A=-1 -> loss -(-0.8) = 0.8
    one = torch.ones(1, 1, dtype=F64)
    a1 = torch.tensor([1.0], dtype=F64)
    assert grpo_clip_loss(lp([[0.6]]), lp([[0.4]]), a1, one)[0].item() == pytest.approx(-1.2)
    assert grpo_clip_loss(lp([[0.2]]), lp([[0.4]]), -a1, one)[0].item() == pytest.approx(0.8)


# ---------------------------------------------------------------- log-probs, entropy


def test_token_logprobs():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])  # [1, 2, 3]
    tokens = torch.tensor([[2, 0]])
    # log(e^3 / (e + e^2 + e^3)) = -log(1 + e^-1 + e^-2) = -0.4076059644; uniform: -log 3
    out = token_logprobs(logits, tokens)
    assert out.shape == (1, 2) and out.dtype == torch.float32
    assert out[0].tolist() == pytest.approx([-0.4076059644, -math.log(3)], abs=1e-6)
    assert torch.allclose(out, logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0])


def test_token_logprobs_bfloat16_in_float32():
    torch.manual_seed(0)
    logits = (torch.randn(2, 5, 50) * 5).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 5))
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32
    ref = logits.float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(out, ref, atol=1e-5)


def test_entropy_from_logits():
    # uniform over 4 -> ln 4; p = (e^1, e^0)/(e+1): -sum p log p = 0.5822031
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, -1e9, -1e9]]]).to(torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32
    p = math.e / (math.e + 1)
    expected = -(p * math.log(p) + (1 - p) * math.log(1 - p))  # 0.5822031
    assert h[0].tolist() == pytest.approx([math.log(4), expected], abs=1e-5)
    # -inf logits (masked vocabulary) add nothing instead of NaN
    h = entropy_from_logits(torch.tensor([[[1.0, 0.0, -math.inf]]]))
    assert h.item() == pytest.approx(expected, abs=1e-6)


# ---------------------------------------------------------------- metrics


def test_masked_mean_ignores_masked_nan():
    x = torch.tensor([1.0, 2.0, math.nan])
    assert masked_mean(x, torch.tensor([1, 1, 0])).item() == pytest.approx(1.5)
    assert masked_mean(x, torch.zeros(3)).item() == 0.0


def test_logprob_gap():
    # response tokens: old - logp = -1.5 - (-1) = -0.5 and -1 - (-2) = 1
    #   mean |gap| = 0.75, max |gap| = 1, k1 = (-0.5 + 1) / 2 = 0.25; third token masked out
    logp = torch.tensor([[-1.0, -2.0, -9.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0]])
    g = logprob_gap(logp, old, torch.tensor([[1, 1, 0]]))
    assert g == pytest.approx({"logprob_abs_gap": 0.75, "logprob_abs_gap_max": 1.0,
                               "kl_k1": 0.25})


def test_batch_metrics():
    # two groups of 4; one infra failure in each of groups 0 and 1 -> 2/8 = 0.25
    rewards = [1.0, None, 0.0, 0.0, 1.0, 1.0, None, 1.0]
    valid = [True, False, True, True, True, True, False, True]
    groups = [group_advantages(rewards[:4], valid[:4]), group_advantages(rewards[4:], valid[4:])]
    m = batch_metrics(rewards, valid, groups)
    assert m["infra_failure_rate"] == pytest.approx(0.25)
    assert m["filtered_group_rate"] == pytest.approx(0.5)  # group 1 is zero_std
    assert m["filtered_zero_std"] == 1 and m["filtered_too_few_valid"] == 0
    # valid rewards 1, 0, 0, 1, 1, 1 -> 4/6
    assert m["reward_mean"] == pytest.approx(4 / 6)
    assert m["rollouts"] == 8 and m["groups"] == 2


def test_step_metrics_leave_verifier_errors_out_of_the_reward():
    """Rewards 1 and 0 scored, one verifier error (reward None), one infra failure: the mean
    is (1 + 0) / 2, not (1 + 0 + 0) / 3; 1 of 3 valid rollouts had a verifier error."""
    from tmax.rollout.trajectory import Trajectory
    from tmax.train.loop import step_metrics
    from tmax.train.rollouts import SamplerStats

    trajs = [Trajectory("t", "p", reward=1.0), Trajectory("t", "p", reward=0.0),
             Trajectory("t", "p", verifier_error="needs network at grade time"),
             Trajectory("t", "p", infra_failure={"cause": "sandbox lost"})]
    stats = SamplerStats(groups_done=1, rollouts=trajs)
    group = type("G", (), {"trajectories": trajs, "version": 0, "advantages": group_advantages(
        [1.0, 0.0, None, None], [True, True, False, False])})()
    m = step_metrics(stats, [group], step=1)
    assert m["reward_mean"] == pytest.approx(0.5)
    assert m["verifier_error_rate"] == pytest.approx(1 / 3)
    assert m["infra_failure_rate"] == pytest.approx(0.25)
    assert m["batch_reward_mean"] == pytest.approx(0.5)
