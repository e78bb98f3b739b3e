"""The mismatch correction's math (grpo.algo.correction): hand-computed numbers, and a planted
mismatch (the sampler at temperature 1.1, the trainer at 1.0) that token_tis corrects in
expectation and sequence_mask masks."""

import math

import pytest
import torch

from grpo.algo import aggregate, policy_loss
from grpo.algo.correction import engine_correction, mismatch_kl, mismatch_log_ratio


def test_the_weights_and_the_kl_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    sampled = torch.tensor([[-1.5, -0.5, -0.5], [-0.2, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # log r = old - sampled = [[0.5, -1.5, 0], [-0.8, 0, (masked)]]
    torch.testing.assert_close(mismatch_log_ratio(old, sampled, mask), torch.tensor([[0.5, -1.5, 0.0], [-0.8, 0, 0]]))
    r = torch.tensor([[math.exp(0.5), math.exp(-1.5), 1.0], [math.exp(-0.8), 1.0, 1.0]])
    torch.testing.assert_close(mismatch_kl(old, sampled, mask), (r - 1 - r.log()) * mask)

    weights, changed = engine_correction(old, sampled, mask, "token_tis", cap=1.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-1.5), 1.0], [math.exp(-0.8), 1.0, 1.0]]))
    assert changed.tolist() == [[True, False, False], [False, False, False]]  # e^0.5 = 1.65 > 1.5

    # Sequence log-ratios: 0.5 - 1.5 = -1.0 and -0.8; with C = 2.5 (log C = 0.92) the first is out.
    weights, changed = engine_correction(old, sampled, mask, "sequence_mask", cap=2.5)
    assert weights.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert changed.tolist() == [[True, True, True], [False, False, False]]  # its loss-mask tokens
    weights, _ = engine_correction(old, sampled, mask, "sequence_mask", cap=3.0)  # log 3 = 1.10: both in
    assert bool((weights == 1).all())

    weights, changed = engine_correction(old, sampled, mask, "none", cap=2.0)
    assert bool((weights == 1).all()) and not changed.any()


def test_a_ratio_below_one_over_c_is_masked_as_one_above_c():
    old = torch.zeros(2, 2)
    sampled = torch.tensor([[-0.4, -0.4], [0.4, 0.4]])  # log R = +0.8, -0.8
    weights, _ = engine_correction(old, sampled, torch.ones(2, 2), "sequence_mask", cap=2.0)  # log 2 = 0.69
    assert weights.tolist() == [[0, 0], [0, 0]]


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="cap"):
        engine_correction(x, x, x, "token_tis", cap=1.0)
    with pytest.raises(ValueError, match="mode"):
        engine_correction(x, x, x, "token_mask", cap=2.0)


# ---- a planted mismatch -----------------------------------------------------------------------
# A policy over V tokens, the same categorical at each of T positions (a sequence model with
# no context). The trainer scores softmax(theta), the sampler draws from softmax(theta / 1.1).
# The on-policy gradient of E_pi[sum_t f(o_t)] is known exactly; the loss's gradient on the
# sampler's tokens estimates it. (Without context no prefix is off-policy, so token-level
# weights correct the whole gradient here.)

V, T = 6, 3
THETA = torch.tensor([1.5, 0.8, 0.2, -0.3, -1.0, 0.4])
F = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0, 0.0])  # the per-token advantage of each token
TOLERANCE = 0.006  # on a Monte Carlo gradient of 200k sequences: ~5 standard errors


def on_policy_gradient():
    """d/dtheta E_pi[sum_t f(o_t)] = T * sum_x pi(x) f(x) d log pi(x)."""
    theta = THETA.clone().requires_grad_(True)
    (T * (theta.softmax(0) * F).sum()).backward()
    return theta.grad


def loss_gradient(mode, cap, n, seed):
    """-d loss / d theta on n sampled sequences: the clipped loss of one epoch (ratio 1),
    each token's weight from `engine_correction`, summed over tokens and averaged over
    sequences (seq-mean-token-sum-norm with max_tokens 1)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial((THETA / 1.1).softmax(0), n * T, replacement=True, generator=generator).view(n, T)
    sampled_logprobs = (THETA / 1.1).log_softmax(0)[tokens]  # (n, T) what the sampler reports
    theta = THETA.clone().requires_grad_(True)
    logprobs = theta.log_softmax(0)[tokens]  # (n, T)
    mask = torch.ones(n, T)
    weights, _ = engine_correction(logprobs.detach(), sampled_logprobs, mask, mode, cap=cap)
    per_token = policy_loss(logprobs, logprobs.detach(), F[tokens], mask) * weights
    aggregate(per_token, mask, "seq-mean-token-sum-norm", max_tokens=1).backward()
    return -theta.grad


def test_token_tis_corrects_a_planted_temperature_mismatch_in_expectation():
    """With a cap above every ratio (the largest pi / pi_sampler here is 1.065), the weighted
    gradient is unbiased: its Monte Carlo mean over 200k sequences is the on-policy gradient
    to ~5 standard errors (one is at most 0.0013 here, measured over seeds), where the
    uncorrected one is off by over 40 of them (0.058)."""
    exact = on_policy_gradient()
    ratio_max = float((THETA.log_softmax(0) - (THETA / 1.1).log_softmax(0)).exp().max())
    assert 1.0 < ratio_max < 2.0
    corrected = loss_gradient("token_tis", 2.0, 200_000, seed=0)
    uncorrected = loss_gradient("none", 2.0, 200_000, seed=0)
    assert (corrected - exact).abs().max() < TOLERANCE, (corrected, exact)
    assert (uncorrected - exact).abs().max() > 5 * TOLERANCE, (uncorrected, exact)


def test_the_cap_truncates_the_weights_and_so_biases_the_gradient():
    """A cap below the largest ratio truncates: the gradient is then E_sampler[min(r, C) f
    d log pi], computed exactly here (0.03 off the on-policy one at C = 1.02)."""
    cap = 1.02
    q = (THETA / 1.1).softmax(0)
    ratio = THETA.softmax(0) / q
    theta = THETA.clone().requires_grad_(True)
    (T * (q * ratio.clamp(max=cap) * F * theta.log_softmax(0)).sum()).backward()
    truncated = theta.grad
    got = loss_gradient("token_tis", cap, 200_000, seed=1)
    assert (got - truncated).abs().max() < TOLERANCE
    assert (got - on_policy_gradient()).abs().max() > 3 * TOLERANCE


def test_sequence_mask_leaves_out_of_bounds_sequences_no_gradient():
    """Each sequence with its own parameters: a masked sequence's gradient is exactly 0, a kept
    one's is the uncorrected gradient (weight 1, not its ratio)."""
    n = 400
    generator = torch.Generator().manual_seed(2)
    tokens = torch.multinomial((THETA / 1.1).softmax(0), n * T, replacement=True, generator=generator).view(n, T)
    sampled_logprobs = (THETA / 1.1).log_softmax(0)[tokens]
    cap = 1.1
    grads = {}
    for mode in ("sequence_mask", "none"):
        theta = THETA.repeat(n, 1).requires_grad_(True)  # (n, V): one policy per sequence
        logprobs = theta.log_softmax(1).gather(1, tokens)  # (n, T)
        mask = torch.ones(n, T)
        weights, _ = engine_correction(logprobs.detach(), sampled_logprobs, mask, mode, cap=cap)
        (policy_loss(logprobs, logprobs.detach(), F[tokens], mask) * weights).sum().backward()
        grads[mode] = theta.grad
    log_ratio = (THETA.log_softmax(0)[tokens] - sampled_logprobs).sum(1)  # (n,) log prod_t r_t
    out = log_ratio.abs() > math.log(cap)
    assert 0 < int(out.sum()) < n  # the planted mismatch puts some sequences out, not all
    assert bool((grads["sequence_mask"][out] == 0).all())
    assert bool((grads["none"][out] != 0).any())
    assert torch.equal(grads["sequence_mask"][~out], grads["none"][~out])
