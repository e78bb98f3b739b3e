import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.algo import entropy, token_logprobs
from tests.helpers import assert_close_scaled, scale_of

pytestmark = pytest.mark.numerics  # compares kernels: `make test` runs it with AVX2 kernels too


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax = [1/4, 3/4]
    ids = torch.tensor([[1]])
    torch.testing.assert_close(token_logprobs(logits, ids), torch.tensor([[math.log(0.75)]]))
    # Temperature 2 halves the logits: softmax = [1, sqrt 3] / (1 + sqrt 3).
    want = math.log(math.sqrt(3) / (1 + math.sqrt(3)))
    torch.testing.assert_close(token_logprobs(logits, ids, temperature=2.0), torch.tensor([[want]]))


def test_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy(logits), torch.tensor([[want, math.log(2.0)]]))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)


def test_repetition_penalty_by_hand():
    """Position t's scores are penalised on the context and on the tokens before t, not on t's own."""
    logits = torch.tensor([[[2.0, -1.0, 0.5], [2.0, -1.0, 0.5]]])  # (1, 2, 3)
    ids = torch.tensor([[1, 2]])
    context = torch.tensor([[-1, 0]])  # padding, then token 0
    got = token_logprobs(logits, ids, repetition_penalty=2.0, context=context)
    first = torch.log_softmax(torch.tensor([1.0, -1.0, 0.5]), -1)[1]  # token 0 seen: 2 / 2
    second = torch.log_softmax(torch.tensor([1.0, -2.0, 0.5]), -1)[2]  # token 1 drawn at 0: -1 * 2
    torch.testing.assert_close(got, torch.stack([first, second])[None])
    # A penalty below 1 favours repeats; 1 is no penalty, whatever the context.
    torch.testing.assert_close(
        token_logprobs(logits, ids, repetition_penalty=1.0, context=context), token_logprobs(logits, ids)
    )
    ent = entropy(logits, repetition_penalty=0.5, ids=ids, context=context)
    p = torch.softmax(torch.tensor([4.0, -1.0, 0.5]), -1)
    torch.testing.assert_close(ent[0, 0], -(p * p.log()).sum())


def test_bad_penalty_arguments_are_rejected():
    logits, ids = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="needs the context"):
        token_logprobs(logits, ids, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        token_logprobs(logits, ids, repetition_penalty=0.0, context=ids)
    with pytest.raises(ValueError, match="needs the sampled ids"):
        entropy(logits, repetition_penalty=1.3, context=ids)


def naive_penalized(logits: torch.Tensor, ids: torch.Tensor, context: torch.Tensor, penalty: float) -> torch.Tensor:
    """The scores the sampler drew position t from, built position by position."""
    n, t_len, vocab = logits.shape
    seen = torch.zeros(n, t_len, vocab, dtype=torch.bool)
    for i in range(n):
        for t in range(t_len):
            for token in context[i].tolist() + ids[i, :t].tolist():
                if token >= 0:
                    seen[i, t, token] = True
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 3),
    t_len=st.integers(1, 6),
    p_len=st.integers(0, 4),
    vocab=st.integers(2, 12),  # small, so that tokens repeat
    temperature=st.sampled_from([1.0, 0.7]),
    penalty=st.sampled_from([1.6, 0.6]),
    chunk_elements=st.sampled_from([1, 37, 1 << 24]),
)
def test_penalized_logprobs_match_the_penalized_log_softmax(
    seed, n, t_len, p_len, vocab, temperature, penalty, chunk_elements
):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, t_len, vocab, generator=g)).requires_grad_(True)  # both signs
    ids = torch.randint(0, vocab, (n, t_len), generator=g)
    context = torch.randint(-1, vocab, (n, p_len), generator=g)  # -1 = padding
    weights = torch.randn(n, t_len, generator=g)

    got = token_logprobs(
        logits, ids, temperature=temperature, repetition_penalty=penalty, context=context, chunk_elements=chunk_elements
    )
    scores = naive_penalized(logits, ids, context, penalty) / temperature
    want = torch.log_softmax(scores, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert_close_scaled(got, want, scale=scale_of(scores))  # rounding scales with the scores (lse)
    (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (grad_want,) = torch.autograd.grad((want * weights).sum(), logits)
    assert_close_scaled(grad_got, grad_want, scale=scale_of(weights))  # weights x (one-hot - softmax)

    ent = entropy(
        logits.detach(),
        temperature=temperature,
        repetition_penalty=penalty,
        ids=ids,
        context=context,
        chunk_elements=chunk_elements,
    )
    p = torch.softmax(scores.detach(), -1)
    assert_close_scaled(ent, -(p * torch.log(p)).sum(-1), scale=scale_of(scores))  # lse - E[x]


@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 4),
    t_len=st.integers(1, 6),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    chunk_elements=st.sampled_from([1, 37, 1 << 24]),  # one row per chunk, ragged, one chunk
)
def test_chunked_logprobs_match_log_softmax_gather(seed, n, t_len, vocab, temperature, chunk_elements):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, t_len, vocab, generator=g)).requires_grad_(True)
    ids = torch.randint(0, vocab, (n, t_len), generator=g)
    weights = torch.randn(n, t_len, generator=g)

    got = token_logprobs(logits, ids, temperature=temperature, chunk_elements=chunk_elements)
    want = torch.log_softmax(logits / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert_close_scaled(got, want, scale=scale_of(logits / temperature))
    (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (grad_want,) = torch.autograd.grad((want * weights).sum(), logits)
    assert_close_scaled(grad_got, grad_want, scale=scale_of(weights))  # weights x (one-hot - softmax)

    ent = entropy(logits.detach(), temperature=temperature, chunk_elements=chunk_elements)
    p = torch.softmax(logits.detach() / temperature, -1)
    assert_close_scaled(ent, -(p * torch.log(p)).sum(-1), scale=scale_of(logits / temperature))


def test_bf16_logits_give_float32_logprobs_and_bf16_gradients():
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(3, 5, 50, generator=g)).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 5), generator=g)
    got = token_logprobs(logits, ids, chunk_elements=64)
    assert got.dtype == torch.float32
    want = torch.log_softmax(logits.detach().float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert_close_scaled(got, want, scale=scale_of(logits))
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_(True)
    torch.log_softmax(ref, -1).gather(-1, ids.unsqueeze(-1)).sum().backward()
    assert_close_scaled(logits.grad.float(), ref.grad, 2, dtype=torch.bfloat16)  # rounded to bf16 once


def test_logits_are_not_modified():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    before = logits.detach().clone()
    out = token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.5, chunk_elements=7)
    out.sum().backward()
    assert torch.equal(logits.detach(), before)


class LargestTensor(TorchDispatchMode):
    """Records the largest float32 tensor any operator produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_full_vocabulary_float32_copy_of_the_logits():
    n, t_len, vocab = 8, 16, 1000
    logits = torch.randn(n, t_len, vocab).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, vocab, (n, t_len))
    chunk = 10 * vocab  # ten rows of scratch at a time
    with LargestTensor() as seen:
        out = token_logprobs(logits, ids, temperature=0.9, chunk_elements=chunk)
        out.sum().backward()
        entropy(logits.detach(), chunk_elements=chunk)
        # With a repetition penalty: its masks are built per chunk too.
        context = torch.randint(0, vocab, (n, 4))
        out = token_logprobs(logits, ids, repetition_penalty=1.2, context=context, chunk_elements=chunk)
        out.sum().backward()
        entropy(logits.detach(), repetition_penalty=1.2, ids=ids, context=context, chunk_elements=chunk)
    assert seen.largest <= chunk  # against n * t_len * vocab = 128,000 for log_softmax(...float())
    with LargestTensor() as naive:
        torch.log_softmax(logits.float(), -1)
    assert naive.largest == n * t_len * vocab  # the probe does see the naive copy
