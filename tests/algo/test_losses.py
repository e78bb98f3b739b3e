import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.algo import aggregate, bradley_terry_loss, clipped_fraction, policy_loss, value_loss
from grpo.algo.losses import AGGREGATIONS
from tests.helpers import random_batch, right_padded_mask

MODES = sorted(AGGREGATIONS)

# ---- hand-computed numbers -------------------------------------------------------------


def test_policy_loss_by_hand():
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    got = policy_loss(logprobs, old, advantages, torch.ones(1, 3))
    # -min(r A, clip(r, 0.8, 1.2) A): 1.5 -> -1.2;  0.5 with A<0 -> clip to 0.8 -> 0.8;  1.1 -> -1.1
    torch.testing.assert_close(got, torch.tensor([[-1.2, 0.8, -1.1]]))
    higher = policy_loss(logprobs, old, advantages, torch.ones(1, 3), clip_high=0.28)
    torch.testing.assert_close(higher, torch.tensor([[-1.28, 0.8, -1.1]]))


def test_sequence_advantages_broadcast_and_padding_is_zero():
    logprobs = torch.log(torch.tensor([[1.5, 1.0], [1.0, 1.0]]))
    got = policy_loss(logprobs, torch.zeros(2, 2), torch.tensor([1.0, -2.0]), torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    torch.testing.assert_close(got, torch.tensor([[-1.2, 0.0], [2.0, 2.0]]))


def test_dual_clip_caps_negative_advantage_losses():
    logprobs = torch.log(torch.tensor([[5.0, 5.0]]))
    advantages = torch.tensor([[-1.0, 1.0]])
    plain = policy_loss(logprobs, torch.zeros(1, 2), advantages, torch.ones(1, 2))
    dual = policy_loss(logprobs, torch.zeros(1, 2), advantages, torch.ones(1, 2), dual_clip=3.0)
    torch.testing.assert_close(plain, torch.tensor([[5.0, -1.2]]))  # ratio 5 is unbounded for A<0
    torch.testing.assert_close(dual, torch.tensor([[3.0, -1.2]]))  # capped at -c * A = 3
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, torch.zeros(1, 2), advantages, torch.ones(1, 2), dual_clip=0.5)


def test_dual_clip_is_trls_delta():
    """TRL's GRPOConfig.delta (INTELLECT-2) caps the ratio inside the unclipped term,
    -min(min(rho, delta) * A, clip(rho) * A): the same loss and gradients as dual_clip = delta
    (docs/coming-from-trl.md maps one to the other)."""
    g = torch.Generator().manual_seed(0)
    logprobs = (torch.randn(64, 8, generator=g) * 1.5).requires_grad_()
    advantages, mask, delta = torch.randn(64, 8, generator=g), torch.ones(64, 8), 2.5
    ratio = torch.exp(logprobs)  # old log-probs 0
    trl = -torch.minimum(torch.clamp(ratio, max=delta) * advantages, torch.clamp(ratio, 0.8, 1.28) * advantages)
    ours = policy_loss(logprobs, torch.zeros(64, 8), advantages, mask, clip_high=0.28, dual_clip=delta)
    assert bool(((ratio > delta) & (advantages < 0)).any())  # the cap is reached
    torch.testing.assert_close(ours, trl)
    (grad_ours,) = torch.autograd.grad(ours.sum(), logprobs, retain_graph=True)
    (grad_trl,) = torch.autograd.grad(trl.sum(), logprobs)
    torch.testing.assert_close(grad_ours, grad_trl)


def test_gspo_sequence_ratio_by_hand():
    # log-ratios [ln 2, 0] -> sequence ratio exp(ln 2 / 2) = sqrt 2, clipped to 1.2 for A > 0.
    logprobs = torch.tensor([[math.log(2.0), 0.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    got = policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask, level="sequence")
    torch.testing.assert_close(got, torch.tensor([[-1.2, -1.2, 0.0]]))
    wide = policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask, level="sequence", clip_high=1.0)
    torch.testing.assert_close(wide, torch.tensor([[-math.sqrt(2), -math.sqrt(2), 0.0]]))


def test_clipped_fraction_by_hand():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]]))
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    # Clipped: 1.5 with A>0, 0.5 with A<0. Not: 1.1 (inside), 1.5 with A<0 (clip does not bind).
    got = clipped_fraction(logprobs, torch.zeros(1, 4), advantages, torch.ones(1, 4))
    assert float(got) == pytest.approx(0.5)


def test_aggregate_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(x, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(x, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / (2 * 3))
    assert float(aggregate(x, mask, "seq-mean-token-sum-norm", max_tokens=5)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(x, mask, "mean")


def test_value_loss_by_hand():
    values, old, returns = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 2.0]]), torch.tensor([[2.0, 4.0]])
    mask = torch.ones(1, 2)
    # Squared errors (1 - 2)^2 = 1 and (2 - 4)^2 = 4: no clip gives 0.5 * mean(1, 4) = 1.25.
    assert float(value_loss(values, old, returns, mask)) == pytest.approx(1.25)
    # Clip 0.2: token 0's clipped value 0.7 is further from 2 ((0.7 - 2)^2 = 1.69), and counts.
    assert float(value_loss(values, old, returns, mask, clip=0.2)) == pytest.approx(0.5 * (1.69 + 4.0) / 2)
    assert float(value_loss(values, old, returns, torch.tensor([[0.0, 1.0]]))) == pytest.approx(2.0)


def test_bradley_terry_loss_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 3.0])
    # Margins 2, 0, -2: -log sigmoid(m) = log(1 + e^-m) = log(1 + e^-2), log 2, log(1 + e^2).
    expected = (math.log1p(math.exp(-2.0)) + math.log(2.0) + math.log1p(math.exp(2.0))) / 3
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(expected)
    # Only the margin matters: shifting both rewards by a constant changes nothing.
    assert float(bradley_terry_loss(chosen + 5.0, rejected + 5.0)) == pytest.approx(expected)


def test_bradley_terry_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([0.5, -1.0, 3.0], requires_grad=True)
    rejected = torch.tensor([0.0, 2.0, 3.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    # d loss / d r_chosen = -(1 - sigmoid(m)) / N < 0: a descent step raises r_chosen.
    expected = -(1 - torch.sigmoid(chosen.detach() - rejected.detach())) / 3
    torch.testing.assert_close(chosen.grad, expected)
    torch.testing.assert_close(rejected.grad, -expected)  # and lowers r_rejected as much
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_bradley_terry_loss_is_finite_for_huge_margins():
    # log(sigmoid(-100)) is -inf in float32; logsigmoid gives the exact 100.
    chosen = torch.tensor([100.0, -100.0], requires_grad=True)
    rejected = torch.zeros(2)
    loss = bradley_terry_loss(chosen, rejected)
    loss.backward()
    assert loss.item() == pytest.approx((0.0 + 100.0) / 2)
    assert torch.isfinite(chosen.grad).all()
    torch.testing.assert_close(chosen.grad, torch.tensor([0.0, -0.5]))


# ---- invariants -------------------------------------------------------------------------


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 6),
    t_len=st.integers(1, 8),
    clip_low=st.floats(0.01, 0.9),
    clip_high=st.floats(0.01, 3.0),
    level=st.sampled_from(["token", "sequence"]),
)
def test_on_policy_ratio_is_one_and_clipping_changes_nothing(seed, n, t_len, clip_low, clip_high, level):
    logprobs, _, advantages, mask = random_batch(seed, n, t_len)
    logprobs.requires_grad_(True)
    old = logprobs.detach()  # mu = 1: the old policy is the current one
    loss = policy_loss(logprobs, old, advantages, mask, clip_low=clip_low, clip_high=clip_high, level=level)
    unclipped = policy_loss(logprobs, old, advantages, mask, clip_low=1e9, clip_high=1e9, level=level)
    torch.testing.assert_close(loss, -advantages.unsqueeze(1) * mask)
    torch.testing.assert_close(loss, unclipped)
    assert float(clipped_fraction(logprobs, old, advantages, mask, clip_low=clip_low, clip_high=clip_high)) == 0.0
    # The gradient is the plain policy gradient, -A * grad log pi, whatever the clip range.
    (grad,) = torch.autograd.grad(aggregate(loss, mask, "token-mean"), logprobs)
    (plain,) = torch.autograd.grad(aggregate(unclipped, mask, "token-mean"), logprobs)
    torch.testing.assert_close(grad, plain)


def naive_policy_loss(logprobs, old, advantages, mask, clip_low, clip_high):
    out = torch.zeros_like(logprobs)
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[i, t]:
                r = math.exp(float(logprobs[i, t] - old[i, t]))
                a = float(advantages[i])
                out[i, t] = -min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
    return out


@given(seed=st.integers(0, 10_000), n=st.integers(1, 5), t_len=st.integers(1, 6))
def test_policy_loss_matches_the_scalar_formula(seed, n, t_len):
    logprobs, old, advantages, mask = random_batch(seed, n, t_len)
    got = policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(got, naive_policy_loss(logprobs, old, advantages, mask, 0.2, 0.28))


def split_points(draw_ints, n):
    cuts = sorted({c for c in draw_ints if 0 < c < n})
    return [0, *cuts, n]


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 9),
    t_len=st.integers(1, 8),
    cuts=st.lists(st.integers(1, 8), max_size=4),
    mode=st.sampled_from(MODES),
    trim=st.booleans(),
)
def test_micro_batches_sum_to_the_full_batch_loss_and_gradient(seed, n, t_len, cuts, mode, trim):
    logprobs, old, advantages, mask = random_batch(seed, n, t_len)
    logprobs.requires_grad_(True)

    full = aggregate(policy_loss(logprobs, old, advantages, mask), mask, mode)
    (full_grad,) = torch.autograd.grad(full, logprobs)

    totals = dict(num_sequences=n, num_tokens=float(mask.sum()), max_tokens=t_len)
    bounds = split_points(cuts, n)
    accumulated = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(logprobs)
    for start, stop in zip(bounds, bounds[1:]):
        # A micro-batch, optionally trimmed of its padding columns as a collator would do.
        width = int(mask[start:stop].sum(1).max()) if trim else t_len
        lp = logprobs.detach()[start:stop, :width].requires_grad_(True)
        m = mask[start:stop, :width]
        part = aggregate(policy_loss(lp, old[start:stop, :width], advantages[start:stop], m), m, mode, **totals)
        part.backward()
        accumulated += part.detach()
        grad[start:stop, :width] += lp.grad
    torch.testing.assert_close(accumulated, full.detach())
    torch.testing.assert_close(grad, full_grad)


@given(seed=st.integers(0, 10_000), n=st.integers(2, 8), t_len=st.integers(1, 6), cut=st.integers(1, 7))
def test_micro_batches_sum_to_the_full_value_loss(seed, n, t_len, cut):
    g = torch.Generator().manual_seed(seed)
    values, old, returns = torch.randn(3, n, t_len, generator=g, dtype=torch.float64)
    mask = right_padded_mask(torch.randint(1, t_len + 1, (n,), generator=g), t_len).double()
    cut = min(cut, n - 1)
    full = value_loss(values, old, returns, mask, clip=0.2)
    parts = [
        value_loss(values[s], old[s], returns[s], mask[s], clip=0.2, num_tokens=float(mask.sum()))
        for s in (slice(0, cut), slice(cut, n))
    ]
    torch.testing.assert_close(sum(parts), full)
