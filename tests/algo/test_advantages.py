import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.algo import gae, group_advantages, process_advantages, whiten
from tests.helpers import right_padded_mask

# ---- hand-computed numbers -------------------------------------------------------------


def test_group_advantages_by_hand():
    # Group 1: [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    # Group 2: [2, 4, 3, 3]: mean 3, unbiased std sqrt(2 / 3).
    rewards = torch.tensor([1.0, 0, 0, 0, 2, 4, 3, 3])
    got = group_advantages(rewards, 4, eps=0.0)
    s = math.sqrt(2 / 3)
    want = torch.tensor([1.5, -0.5, -0.5, -0.5, -1 / s, 1 / s, 0, 0])
    torch.testing.assert_close(got, want)


def test_group_advantages_eps_is_added_to_the_std():
    got = group_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.1)
    std = math.sqrt(0.5)  # unbiased std of [1, 0]
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5]) / (std + 0.1))


def test_group_advantages_batch_and_none_scales_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1])
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    # Batch mean 5/8; squared deviations 5 * 0.375^2 + 3 * 0.625^2 = 1.875; unbiased: / 7.
    batch_std = math.sqrt(1.875 / 7)
    torch.testing.assert_close(group_advantages(rewards, 4, scale="batch", eps=0.0), centred / batch_std)
    torch.testing.assert_close(group_advantages(rewards, 4, scale="none"), centred)


def test_unscored_rewards_are_left_out_and_get_zero_advantage():
    # Scored: [1, 0, 0]: mean 1/3, unbiased std sqrt((4/9 + 1/9 + 1/9) / 2) = 1/sqrt(3).
    got = group_advantages(torch.tensor([1.0, float("nan"), 0.0, 0.0]), 4, eps=0.0)
    r3 = math.sqrt(3)
    torch.testing.assert_close(got, torch.tensor([2 / 3 * r3, 0.0, -1 / 3 * r3, -1 / 3 * r3]))


def test_equal_rewards_give_zero_advantage():
    got = group_advantages(torch.tensor([0.7, 0.7, 0.7, 0.7]), 4)
    assert torch.equal(got, torch.zeros(4))


def test_group_advantages_rejects_bad_shapes_and_scales():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 4, scale="rank")


def test_process_advantages_by_hand():
    # One group of two outputs. Output 0: steps ending at tokens 1 and 4, rewards 1 and 0.
    # Output 1 (3 valid tokens): steps ending at tokens 0 and 2, rewards 0 and 0.
    # Group step rewards {1, 0, 0, 0}: mean 0.25, std 0.5, normalised 1.5 and -0.5.
    step_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    step_ends = torch.tensor([[1, 4], [0, 2]])
    mask = right_padded_mask([5, 3], 5)
    got = process_advantages(step_rewards, step_ends, mask, 2, eps=0.0)
    want = torch.tensor(
        [
            [1.5 - 0.5, 1.5 - 0.5, -0.5, -0.5, -0.5],  # tokens 0-1 see both steps, 2-4 the last
            [-0.5 - 0.5, -0.5, -0.5, 0.0, 0.0],  # padding is zero
        ]
    )
    torch.testing.assert_close(got, want)


def test_process_advantages_ignores_absent_steps_and_keeps_groups_apart():
    nan = float("nan")
    step_rewards = torch.tensor([[1.0, nan], [0.0, nan], [5.0, 3.0], [9.0, nan]])
    step_ends = torch.tensor([[2, -1], [1, -1], [0, 2], [1, -1]])
    mask = torch.ones(4, 3)
    got = process_advantages(step_rewards, step_ends, mask, 2, eps=0.0)
    # Group 0 has the step rewards {1, 0}: mean 0.5, std sqrt(0.5).
    a = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(got[0], torch.tensor([a, a, a]))
    torch.testing.assert_close(got[1], torch.tensor([-a, -a, 0.0]))
    # Group 1's numbers do not leak into group 0.
    changed = step_rewards.clone()
    changed[2:] = torch.tensor([[-4.0, 7.0], [1.0, nan]])
    torch.testing.assert_close(process_advantages(changed, step_ends, mask, 2, eps=0.0)[:2], got[:2])


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.5)
    # delta = [0, 0, 0.5];  A2 = 0.5, A1 = 0 + 0.5 * 0.5, A0 = 0.5 * 0.25.
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.25, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.75, 1.0]]))


def test_gae_values_past_the_end_count_as_zero():
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.5, 9.0]])  # the 9 sits on padding and must not be used
    adv, ret = gae(rewards, values, torch.tensor([[1.0, 1.0, 0.0]]), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.25, 0.5, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.75, 1.0, 0.0]]))


def test_gae_bootstraps_across_a_loss_masked_token():
    # Tokens 0, 2 and 3 are the policy's; token 1 (a tool's output) is not: token 0's next
    # value is token 2's, and its advantage follows from token 2's.
    rewards = torch.tensor([[0.0, 7.0, 0.0, 1.0]])  # the 7 sits on the tool's token and must not be used
    values = torch.tensor([[0.5, 9.0, 0.25, 0.75]])  # so must the 9
    adv, ret = gae(rewards, values, torch.tensor([[1.0, 0.0, 1.0, 1.0]]), gamma=1.0, lam=0.5)
    # delta3 = 1 - 0.75 = 0.25; delta2 = 0 + 0.75 - 0.25 = 0.5; delta0 = 0 + 0.25 - 0.5 = -0.25.
    # A3 = 0.25, A2 = 0.5 + 0.5 * 0.25 = 0.625, A0 = -0.25 + 0.5 * 0.625 = 0.0625.
    torch.testing.assert_close(adv, torch.tensor([[0.0625, 0.0, 0.625, 0.25]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5625, 0.0, 0.875, 1.0]]))


@given(seed=st.integers(0, 10_000), n=st.integers(1, 4), t_len=st.integers(1, 8), lam=st.floats(0.0, 1.0))
def test_gae_over_a_mask_with_holes_is_gae_over_its_marked_tokens_side_by_side(seed, n, t_len, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    values = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, t_len, generator=g) < 0.6).double()
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=lam)
    for i in range(n):
        marked = mask[i].bool()
        k = int(marked.sum())
        packed_rewards, packed_values = torch.zeros(2, 1, t_len, dtype=torch.float64)  # marked tokens first
        packed_rewards[0, :k], packed_values[0, :k] = rewards[i, marked], values[i, marked]
        packed_mask = right_padded_mask(torch.tensor([k]), t_len).double()
        want_adv, want_ret = gae(packed_rewards, packed_values, packed_mask, gamma=0.9, lam=lam)
        torch.testing.assert_close(adv[i, marked], want_adv[0, :k])
        torch.testing.assert_close(ret[i, marked], want_ret[0, :k])
        assert (adv[i, ~marked] == 0).all() and (ret[i, ~marked] == 0).all()


def test_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # Valid entries [1, 2, 3]: mean 2, unbiased variance 1.
    torch.testing.assert_close(whiten(x, mask, eps=0.0), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(whiten(x, mask, shift_mean=False, eps=0.0), torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


# ---- naive references -------------------------------------------------------------------


def naive_gae(rewards, values, lengths, gamma, lam):
    """A_t = sum_l (gamma * lam)^l delta_{t+l}, straight from the definition."""
    n, t_len = rewards.shape
    adv = torch.zeros(n, t_len, dtype=torch.float64)
    for i in range(n):
        L = int(lengths[i])
        v = [float(values[i, t]) for t in range(L)] + [0.0]
        deltas = [float(rewards[i, t]) + gamma * v[t + 1] - v[t] for t in range(L)]
        for t in range(L):
            adv[i, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(L - t))
    return adv


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 4),
    t_len=st.integers(1, 7),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_gae_matches_the_definition(seed, n, t_len, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    values = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t_len + 1, (n,), generator=g)
    mask = right_padded_mask(lengths, t_len).double()
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    want = naive_gae(rewards, values, lengths, gamma, lam)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(ret, (want + values) * mask)


# ---- invariants -------------------------------------------------------------------------

finite_rewards = st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=24)


@given(rewards=finite_rewards, group_size=st.integers(2, 6), scale=st.sampled_from(["group", "batch", "none"]))
def test_advantages_have_zero_mean_in_every_group(rewards, group_size, scale):
    r = torch.tensor(rewards[: len(rewards) // group_size * group_size], dtype=torch.float64)
    if len(r) == 0:
        return
    adv = group_advantages(r, group_size, scale=scale).view(-1, group_size)
    torch.testing.assert_close(adv.mean(1), torch.zeros(len(adv), dtype=torch.float64), atol=1e-9, rtol=0)


@given(seed=st.integers(0, 10_000), groups=st.integers(1, 4), group_size=st.integers(2, 8))
def test_group_scaled_advantages_have_unit_std(seed, groups, group_size):
    r = torch.randn(groups * group_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = group_advantages(r, group_size, eps=0.0).view(groups, group_size)
    torch.testing.assert_close(adv.std(1), torch.ones(groups, dtype=torch.float64))


@given(seed=st.integers(0, 10_000), groups=st.integers(1, 3), group_size=st.integers(2, 5), t_len=st.integers(1, 6))
def test_one_step_at_the_end_is_outcome_supervision(seed, groups, group_size, t_len):
    # A single step that ends at the last valid token makes process supervision collapse
    # to outcome supervision: every valid token gets its output's group advantage.
    g = torch.Generator().manual_seed(seed)
    n = groups * group_size
    rewards = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t_len + 1, (n,), generator=g)
    mask = right_padded_mask(lengths, t_len).double()
    got = process_advantages(rewards.unsqueeze(1), (lengths - 1).unsqueeze(1), mask, group_size)
    want = group_advantages(rewards, group_size).unsqueeze(1) * mask
    torch.testing.assert_close(got, want)


@given(seed=st.integers(0, 10_000), n=st.integers(1, 4), t_len=st.integers(1, 6), gamma=st.floats(0.5, 1.0))
def test_gae_with_lambda_one_gives_discounted_returns(seed, n, t_len, gamma):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    values = torch.randn(n, t_len, generator=g, dtype=torch.float64)
    mask = torch.ones(n, t_len, dtype=torch.float64)
    _, returns = gae(rewards, values, mask, gamma=gamma, lam=1.0)
    discounts = gamma ** torch.arange(t_len, dtype=torch.float64)
    want = torch.stack([(rewards[:, t:] * discounts[: t_len - t]).sum(1) for t in range(t_len)], 1)
    torch.testing.assert_close(returns, want)


@given(seed=st.integers(0, 10_000), n=st.integers(1, 5), t_len=st.integers(2, 8))
def test_whitened_values_have_zero_mean_and_unit_variance(seed, n, t_len):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, t_len, generator=g, dtype=torch.float64) * 5 + 3
    mask = right_padded_mask(torch.randint(1, t_len + 1, (n,), generator=g), t_len).double()
    if mask.sum() < 2:
        return
    w = whiten(x, mask, eps=0.0)[mask.bool()]
    assert abs(float(w.mean())) < 1e-9
    assert abs(float(w.var()) - 1.0) < 1e-9
