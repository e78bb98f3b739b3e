"""Scoring, the step's fourth seam: how a batch's completions get their rewards.

- `OutcomeScorer`: one reward per completion, the weighted sum of the reward functions'
  scores (`grpo.rewards.score`);
- `ProcessScorer` (DeepSeekMath §4.1.3): rewards per reasoning step (`grpo.rewards.score_steps`);
  a completion's score, for the metrics and the group filter, is its mean step reward.

Both return a `Scored`, so the step reads one shape whichever it has; `build_scorer` picks
one from loss.supervision, once, where the engine is built (the baseline that reads the
steps, `ProcessBaseline`, is picked from the same key).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from grpo.rewards import WeightedReward, score, score_steps
from grpo.rewards.logged import RewardLog
from grpo.train.seams import Scored


class Scorer(Protocol):
    """Called as `grpo.rewards.score` is: row-aligned prompts, completions and data columns."""

    def __call__(
        self,
        rewards: list[WeightedReward],
        prompts: list,
        completions: list[str],
        columns: dict[str, Sequence[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        trainer_state: Any = None,
        log: RewardLog | None = None,
    ) -> Scored: ...


class OutcomeScorer:
    """Outcome supervision: each completion's weighted sum of its reward functions' scores."""

    def __call__(self, rewards, prompts, completions, columns, **context) -> Scored:
        scores = score(rewards, prompts, completions, columns, **context)
        return Scored(scores.total, None, scores.per_function, context.get("log"))


class ProcessScorer:
    """Process supervision: each completion's weighted steps, and their mean as its score."""

    def __call__(self, rewards, prompts, completions, columns, **context) -> Scored:
        scores = score_steps(rewards, prompts, completions, columns, **context)
        return Scored(scores.total, scores.steps, scores.per_function, context.get("log"))


# loss.supervision -> the scorer.
SCORERS: dict[str, Callable[[], Scorer]] = {"outcome": OutcomeScorer, "process": ProcessScorer}


def build_scorer(c) -> Scorer:
    return SCORERS[c.loss.supervision]()
