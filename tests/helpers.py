"""Small builders shared by the tests."""

import torch


def right_padded_mask(lengths, t_len):
    """(N, T) mask with the first lengths[i] entries of row i set, as completions are."""
    lengths = torch.as_tensor(lengths)
    return (torch.arange(t_len).unsqueeze(0) < lengths.unsqueeze(1)).float()


def random_batch(seed, n, t_len, *, min_len=1):
    """Log-probs of a policy and an older policy, advantages and a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(n, t_len, generator=g, dtype=torch.float64) * 3
    old_logprobs = logprobs + 0.3 * torch.randn(n, t_len, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.randint(min_len, t_len + 1, (n,), generator=g)
    return logprobs, old_logprobs, advantages, right_padded_mask(lengths, t_len).double()
