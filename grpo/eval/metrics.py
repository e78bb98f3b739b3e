"""Pass@k and Maj@k: the two curves behind "RL raises Maj@K but not Pass@K".

Both are exact expectations over the C(n, k) ways of choosing k of a prompt's n samples
(without replacement), so they are smooth in k and need no resampling:
- pass@k: the chance that at least one of the k is correct (Chen et al., arXiv 2107.03374).
  `1 - (1 - c/n)^k` is biased (it samples with replacement); it is not used.
- maj@k: the accuracy of a majority vote over the k (DeepSeekMath Fig. 7 plots its mean
  over prompts). Ties among m answers score 1/m for each correct one, i.e. a uniformly
  random pick among the tied answers. Samples with no answer (None) never win a vote while
  any answer was drawn; k unanswered samples score 0.

Beside them, what the reports put around those numbers: `mean_ci` (a mean over problems with
its normal 95% interval) and `over_seeds` (several seeds' results of one setting as one); and
what the reward-hacking alarm (grpo.eval.alarm) asks of a series of evaluations: `slope` (a
least-squares trend) and `fell_beyond` (a drop larger than two 95% intervals allow).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["fell_beyond", "maj_at_k", "mean_ci", "over_seeds", "pass_at_k", "slope"]

Z_95 = 1.96  # two-sided 95% quantile of the standard normal


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, eq. 1).

    `n` samples of which `c` are correct, k <= n. Exact: computed with integer binomials.
    """
    n, c, k = int(n), int(c), int(k)
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _binomial_weights(count: int, p: float) -> np.ndarray:
    """w[x] = C(count, x) p^x (1 - p)^(count - x) for x = 0..count.

    Scaling every binomial coefficient by p^x (1-p)^(count-x) keeps the products in
    `maj_at_k` near 1 instead of near C(n, k), which would overflow float64 for n ~ 1000;
    the scale is the same p^k (1-p)^(n-k) for every way of drawing k, so it divides out.
    """
    x = np.arange(count + 1)
    if p >= 1.0:
        return (x == count).astype(np.float64)
    log_comb = np.array([math.lgamma(count + 1) - math.lgamma(i + 1) - math.lgamma(count - i + 1) for i in x])
    return np.exp(log_comb + x * math.log(p) + (count - x) * math.log1p(-p))


def _correct_flags(answers: list, correct) -> list[bool]:
    """`correct` is either n per-sample flags or the reference answer."""
    if isinstance(correct, (str, bytes)) or not hasattr(correct, "__len__") or len(correct) != len(answers):
        return [a is not None and a == correct for a in answers]
    flags = list(correct.tolist() if hasattr(correct, "tolist") else correct)
    if all(isinstance(f, (bool, np.bool_)) for f in flags):
        return [bool(f) for f in flags]
    return [a is not None and a == correct for a in answers]


def maj_at_k(answers: Sequence[Hashable | None], correct, k: int) -> float:
    """Expected accuracy of a majority vote over k of the n samples, drawn without replacement.

    `answers`: the n extracted answers (hashable; None = no answer). `correct`: n booleans
    (sample i is correct; an answer counts as correct if any of its samples is) or the
    reference answer itself. Ties among m answers count 1/m for each correct one; None never
    wins a vote while any answer was drawn.

    Exact: for each correct answer a and each number v of its copies drawn, a dynamic
    programme over the other answers counts the draws in which none exceeds v, tracking how
    many tie at v. O(n^2 * k * m) for m distinct answers; brute force is O(C(n, k)).
    """
    answers = list(answers)
    n, k = len(answers), int(k)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    flags = _correct_flags(answers, correct)
    counts = Counter(a for a in answers if a is not None)
    n_none = n - sum(counts.values())
    right = {a for a, ok in zip(answers, flags) if ok and a is not None}
    if not right:
        return 0.0
    p = k / n
    weights = {c: _binomial_weights(c, p) for c in {*counts.values(), n_none}}
    total = 0.0
    for answer in right:
        others = [c for b, c in counts.items() if b != answer]
        ties = np.arange(len(others) + 1)  # t other answers tied with ours at the top
        for v in range(1, min(counts[answer], k) + 1):
            rest = k - v  # draws left for the other answers and the unanswered samples
            ways = np.zeros((rest + 1, len(others) + 1))  # ways[s, t]: s drawn, t tying
            ways[0, 0] = 1.0
            for c in others:
                w = weights[c]
                grown = np.zeros_like(ways)
                for x in range(min(c, v, rest) + 1):
                    if x < v:
                        grown[x:, :] += w[x] * ways[: rest + 1 - x, :]
                    else:  # x == v: this answer ties with ours
                        grown[x:, 1:] += w[x] * ways[: rest + 1 - x, :-1]
                ways = grown
            w_none = weights[n_none]
            filled = sum(w_none[x] * ways[rest - x, :] for x in range(min(n_none, rest) + 1))
            total += weights[counts[answer]][v] * float((filled / (1 + ties)).sum())
    return total / float(_binomial_weights(n, p)[k])


def mean_ci(values: list[float]) -> tuple[float, list[float]]:
    """Mean and its normal 95% interval mean +- 1.96 * s / sqrt(P), clipped to [0, 1]."""
    p = len(values)
    mean = sum(values) / p
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (p - 1)) if p > 1 else 0.0
    half = Z_95 * std / math.sqrt(p)
    return mean, [max(0.0, mean - half), min(1.0, mean + half)]


def over_seeds(results: list[dict], metrics: Sequence[str] = ("pass@k", "maj@k")) -> dict:
    """Several seeds' `measure` results for one setting, as one: for each metric, the mean
    over seeds (`metric`), its lowest and highest seed (`metric_range`), and 95% intervals
    over problems of each problem's value averaged over seeds (`metric_ci`); those averaged
    per-problem values under `per_prompt` (for breakdowns by problem)."""
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    averaged = [
        {m: {k: mean([r["per_prompt"][i][m][k] for r in results]) for k in results[0][m]} for m in metrics}
        for i in range(len(results[0]["per_prompt"]))
    ]
    entry: dict = {}
    for metric in metrics:
        ks = list(results[0][metric])
        entry[metric] = {k: mean([r[metric][k] for r in results]) for k in ks}
        entry[f"{metric}_range"] = {
            k: [min(r[metric][k] for r in results), max(r[metric][k] for r in results)] for k in ks
        }
        entry[f"{metric}_ci"] = {k: mean_ci([p[metric][k] for p in averaged])[1] for k in ks}
    entry["per_prompt"] = averaged
    return entry


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys against xs (0.0 where the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0


def fell_beyond(first: float, first_half: float, last: float, last_half: float) -> bool:
    """Whether a mean fell from `first` to `last` by more than sqrt(h_first^2 + h_last^2),
    their 95% half-widths combined as those of two independent means: a one-sided test of
    the difference at 2.5%."""
    return first - last > math.hypot(first_half, last_half)
