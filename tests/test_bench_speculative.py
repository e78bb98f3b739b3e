"""benchmarks/bench_speculative.py's probe: the drafts it proposes, and that its exact rule
draws from the model's own distribution (the tokens-a-pass figure it prints rests on it)."""

import itertools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.bench_speculative import lookup_draft, sample_with_lookup


def test_the_draft_continues_the_latest_earlier_occurrence_of_the_longest_tail():
    context = [5, 1, 2, 3, 9, 1, 2, 3, 7, 0, 2, 3]
    assert lookup_draft(context, 2) == [7, 0]  # tail [0, 2, 3] never occurs; [2, 3] last at 6
    assert lookup_draft([4, 1, 2, 8, 6, 1, 2, 9, 1, 2], 3) == [9, 1, 2]  # [1, 2]: the later occurrence
    assert lookup_draft([1, 2, 3, 4, 2, 3], 5) == [4, 2, 3]  # cut at the context's end
    assert lookup_draft([1, 2, 3, 4], 2) == []  # no earlier occurrence of any tail


def test_drafted_tokens_are_kept_so_that_the_draws_are_the_models():
    """Two tokens after a prompt whose n-grams repeat (so most steps have a draft), 3,000
    times: each pair's frequency against its probability under the model, by a chi-square
    test at a fixed seed (a rule keeping every drafted token fails it)."""
    torch.manual_seed(0)
    vocab = 5
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # peaked distributions: drafts are often kept, often not
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        pairs = {}
        for a in range(vocab):
            second = torch.softmax(model(torch.tensor([[*prompt, a]])).logits[0, -1], -1)
            for b in range(vocab):
                pairs[(a, b)] = float(first[a] * second[b])
    generator = torch.Generator().manual_seed(1)
    counts = dict.fromkeys(itertools.product(range(vocab), repeat=2), 0)
    passes = n = 0
    for _ in range(3000):
        tokens, used, _ = sample_with_lookup(model, prompt, 2, eos=-1, generator=generator, new_tokens=2)
        counts[tuple(tokens[:2])] += 1
        passes, n = passes + used, n + 1
    assert passes < 2 * n  # drafts were kept: fewer passes than tokens
    expected = {k: p * n for k, p in pairs.items()}
    big = [k for k in expected if expected[k] >= 5]
    rest = sum(expected[k] for k in expected if k not in big)
    statistic = sum((counts[k] - expected[k]) ** 2 / expected[k] for k in big)
    if rest >= 5:
        observed_rest = sum(counts[k] for k in counts if k not in big)
        statistic += (observed_rest - rest) ** 2 / rest
    dof = len(big) - (0 if rest >= 5 else 1)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))  # chi2's sf
    assert p_value > 1e-3, (statistic, dof)
    assert sum(counts.values()) == n == pytest.approx(sum(expected.values()))
