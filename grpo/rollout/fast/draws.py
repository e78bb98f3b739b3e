"""The fast loop's draws: `generate`'s logits processors (`process`) and the ways a token is
drawn from their distribution: multinomial's draw over every row (`_draw`: on the CPU the
unfinished rows' draws computed as multinomial computes them, the finished rows' share of the
stream skipped), or with rollout.draw: fast the inverse CDF (`_inverse_cdf_draw`)."""

from __future__ import annotations

import bisect
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.algo.logprobs import penalize
from grpo.rollout.params import SamplingParams


def process(logits: Tensor, step: int, p: SamplingParams, eos: Tensor | None, seen: Tensor | None = None) -> Tensor:
    """generate's logits processors for one step, in generate's order: (B, V) float32 logits
    -> the scores it samples from (softmax of them). `seen` (B, V) bool marks the tokens of
    each row's sequence so far, prompt included (used when repetition_penalty != 1)."""
    scores = logits
    if p.repetition_penalty != 1.0:
        scores = penalize(scores, seen, p.repetition_penalty)
    if eos is not None and step < p.min_new_tokens:
        scores = scores.index_fill(1, eos, -math.inf)
    if p.temperature != 1.0:
        scores = scores / p.temperature
    if p.top_k:
        top_k = min(p.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, top_k)[0][..., -1, None], -math.inf)
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(-1).cumsum(-1) <= (1 - p.top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    if p.min_p > 0.0:  # after temperature and top-p, relative to the most likely token's probability
        probs = scores.softmax(-1)
        # The most likely token always passes (min_p < 1), so at least one token is kept.
        scores = scores.masked_fill(probs < p.min_p * probs.amax(-1, keepdim=True), -math.inf)
    return scores


_LOW_53 = (1 << 53) - 1  # the bits of a 64-bit draw that make a float64 uniform


def _skip(count: int, generator: torch.Generator | None) -> None:
    """Advance the CPU generator past `count` exponential draws without making them: on the
    CPU, Tensor.exponential_ takes one 64-bit number per element from the generator (and
    nothing else), as int64 random_ does, at a fifth of the cost (no logarithm)."""
    if count:
        torch.empty(count, dtype=torch.int64).random_(generator=generator)


def _exponential_argmax(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """(k,) argmax_v probs[:, v] / q_v with q ~ Exp(1): torch.multinomial's one-sample draw
    on the CPU (q = Tensor.exponential_ over the (k, V) probabilities, then argmax(p / q)),
    number for number, with the logarithm vectorised. exponential_ takes u = the low 53
    bits of one 64-bit draw / 2**53 per element and returns float32(-log1p(-u)) (`_exponential`;
    checked bit for bit against it, tests/rollout/test_fast.py)."""
    return probs.div(_exponential(probs.shape, generator)).argmax(-1)


def _exponential(shape, generator: torch.Generator | None) -> Tensor:
    """torch.empty(shape).exponential_(generator=generator), float32, computed vectorised."""
    bits = torch.empty(shape, dtype=torch.int64).random_(generator=generator)
    u = bits.bitwise_and_(_LOW_53).to(torch.float64).mul_(2.0**-53)
    return u.neg_().log1p_().mul_(-1.0).to(torch.float32)  # -1 * log1p(-u): +0.0 at u = 0, as exponential_


def _cpu_draw(probs: Tensor, rows: list[int], start: int, stop: int, generator: torch.Generator | None) -> list[Tensor]:
    """The tokens of the unfinished `rows` (ascending, in start..stop-1; `probs` (len(rows), V)
    their distributions) drawn as one multinomial over rows start..stop-1 draws them: runs of
    unfinished rows are drawn, the finished rows between them skipped."""
    vocab, out, at, i = probs.shape[1], [], start, 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        _skip((rows[i] - at) * vocab, generator)
        out.append(_exponential_argmax(probs[i : j + 1], generator))
        at, i = rows[j] + 1, j + 1
    _skip((stop - at) * vocab, generator)
    return out


_CDF_BLOCK = 128  # vocabulary entries per block of the two-level lookup (`_inverse_cdf_draw`)


def _inverse_cdf_draw(probs: Tensor, rows: Tensor, segments: Segments) -> Tensor:
    """rollout.draw: fast. The (L,) tokens of the unfinished `rows` (ascending; `probs`
    (L, V) their distributions, softmax outputs, not necessarily normalised), each drawn by
    inverting its cumulative distribution at one float64 uniform u: token v is drawn when
    cdf[v - 1] <= u * total < cdf[v], a probability of p_v / total up to float64 rounding.
    Each segment's generator gives one uniform per row it covers, finished rows included, so
    a row's draw does not depend on which others have ended.

    The lookup has two levels, so that no running sum goes over the whole vocabulary (a
    cumulative sum is a serial loop, one entry after another): the float64 sums of blocks of
    `_CDF_BLOCK` entries (one vectorised pass), their cumulative sum, the block u falls in,
    then the cumulative sum inside that block alone. One pass over each row's probabilities
    where multinomial's draw takes an exponential per vocabulary entry. Other tokens than
    `generate` draws, from the same distribution."""
    n, vocab = probs.shape
    width = -(-vocab // _CDF_BLOCK) * _CDF_BLOCK
    blocks = (F.pad(probs, (0, width - vocab)) if width != vocab else probs).view(n, -1, _CDF_BLOCK)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum_(-1)  # (L, blocks)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # what torch.multinomial refuses; one sync a step
        if not bool(torch.isfinite(total).all()):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    uniforms = [
        torch.rand(stop - start, dtype=torch.float64, generator=g, device=probs.device) for start, stop, g in segments
    ]
    u = torch.cat(uniforms)[rows]  # (L,) the unfinished rows' own
    below = lambda x: torch.nextafter(x, torch.zeros_like(x))  # noqa: E731
    # Kept below the last cumulative value, so that the entry found has a probability > 0
    # (cdf[v] > target >= cdf[v - 1]); float64 rounding of a sum taken two ways could
    # otherwise put it one past the end.
    target = torch.minimum(u * total, below(total))
    block = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # (L,)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inside = blocks[torch.arange(n, device=probs.device), block].to(torch.float64).cumsum_(-1)  # (L, _CDF_BLOCK)
    rest = torch.minimum(target - before, below(inside[:, -1]))
    return block * _CDF_BLOCK + torch.searchsorted(inside, rest[:, None], right=True).squeeze(1)


# Where a step's draw takes its random numbers: (first row, row past the last, generator) per
# stretch of rows: one for every row (from its generator; None: the global stream), or one per prompt.
Segments = list[tuple[int, int, "torch.Generator | None"]]


def _draw(probs: Tensor, rows: Tensor, segments: Segments, everyone: Tensor | None = None) -> Tensor:
    """generate's draw for one step: the (L, V) probabilities of the unfinished `rows`
    (ascending, of the n rows that `segments` cover) -> their (L,) tokens, as one
    `torch.multinomial` over all n rows would draw them (generate's draw covers finished rows
    too, and the random numbers a draw takes depend on its shape), each segment's rows from
    its generator.

    Without `everyone` (the CPU), finished rows cost a skip of the stream, not a draw
    (`_cpu_draw`). With it ((n, V): the rows' last distributions, updated here), the
    multinomial runs over every row, as off the CPU."""
    if everyone is None:
        if not bool(torch.isfinite(probs).all()):  # what torch.multinomial refuses
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        live, parts, i = rows.tolist(), [], 0
        for start, stop, generator in segments:
            j = bisect.bisect_left(live, stop, lo=i)  # this segment's unfinished rows: live[i:j]
            parts += _cpu_draw(probs[i:j], live[i:j], start, stop, generator)
            i = j
        return torch.cat(parts)
    everyone.index_copy_(0, rows, probs)
    return torch.cat([torch.multinomial(everyone[a:b], 1, generator=g) for a, b, g in segments]).squeeze(1)[rows]
