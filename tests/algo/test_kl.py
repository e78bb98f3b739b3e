import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.algo import kl_estimate, kl_penalized_rewards


def test_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([ln2]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * ln2**2]))
    # k3 = pi_ref/pi - log(pi_ref/pi) - 1 = 0.5 + ln 2 - 1
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 + ln2 - 1]))
    torch.testing.assert_close(kl_estimate(logp, ref), kl_estimate(logp, ref, "k3"))


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_penalized_rewards_by_hand():
    logprobs = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    ref_logprobs = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = kl_penalized_rewards(torch.tensor([1.0, 2.0]), logprobs, ref_logprobs, mask, beta=0.5)
    # -beta * k1 on every valid token; the score lands on the last valid one.
    want = torch.tensor([[-0.05, -0.1 + 1.0, 0.0], [-0.2, -0.25, -0.3 + 2.0]])
    torch.testing.assert_close(got, want)


def test_kl_penalized_rewards_uses_the_named_estimator():
    logprobs, ref = torch.tensor([[0.0, 0.3]]), torch.tensor([[0.0, 0.0]])
    got = kl_penalized_rewards(torch.tensor([0.0]), logprobs, ref, torch.ones(1, 2), beta=1.0, kind="k2")
    torch.testing.assert_close(got, torch.tensor([[0.0, -0.045]]))


@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 50))
def test_k1_and_k3_are_unbiased_under_the_policy(seed, vocab):
    # Exact expectation over a categorical pi: E_pi[k1] = E_pi[k3] = KL(pi || pi_ref).
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64), -1)
    exact = (logp.exp() * (logp - ref)).sum()
    for kind in ("k1", "k3"):
        torch.testing.assert_close((logp.exp() * kl_estimate(logp, ref, kind)).sum(), exact)


@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 5.0))
def test_k2_and_k3_are_nonnegative_and_zero_when_policies_agree(seed, scale):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 5
    ref = logp + scale * torch.randn(4, 9, generator=g, dtype=torch.float64)
    for kind in ("k2", "k3"):
        assert (kl_estimate(logp, ref, kind) >= 0).all()
        assert torch.equal(kl_estimate(logp, logp, kind), torch.zeros_like(logp))
    assert torch.equal(kl_estimate(logp, logp, "k1"), torch.zeros_like(logp))
