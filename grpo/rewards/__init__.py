"""Rewards: the reward-function protocol, the built-in rule rewards, and scoring a batch.

`load_rewards` turns the config's (spec, weight) pairs into functions once, before training;
`score` runs them on every batch and returns each function's scores and their weighted sum.
"""

from grpo.rewards.rules import exact_answer, extract_answer, math_answer, r1_format
from grpo.rewards.scoring import BUILTIN_REWARDS, load_rewards, resolve_reward, score, score_steps
from grpo.rewards.types import RewardFn, RewardScores, StepScores, WeightedReward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardScores",
    "WeightedReward",
    "exact_answer",
    "extract_answer",
    "load_rewards",
    "math_answer",
    "r1_format",
    "resolve_reward",
    "score",
    "score_steps",
    "StepScores",
]
